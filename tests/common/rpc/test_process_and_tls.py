"""`rlhf serve` as its own process: LISTENING line, graceful SIGTERM (in-flight calls finish, new
ones are refused); and TLS on the wire."""

import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.config import config_from_dict
from services.common.types import SamplingParams
from services.generation.client import GenerationClient
from services.generation.server import serve
from tests.grpc_helpers import TOKEN, on_free_ports
from tests.waits import wait_until

ROOT = Path(__file__).resolve().parents[3]


def _wait_in_flight(metrics_port: int, method: str, timeout_s: float = 120.0) -> None:
    """Until the server's rlhf_rpc_in_flight shows a `method` call being handled."""
    want = f'rlhf_rpc_in_flight{{method="{method}",service="generation"}} 1.0'
    wait_until(
        lambda: want
        in httpx.get(
            f"http://127.0.0.1:{metrics_port}/metrics", timeout=30, headers={"Authorization": f"Bearer {TOKEN}"}
        ).text,
        f"a {method} call in flight",
        timeout_s,
        every_s=0.05,
    )


def test_serve_process_graceful_sigterm(cfg, tmp_path):
    conf = tmp_path / "c.yaml"
    conf.write_text(
        f"model: {{path: {cfg.model.path}, device: cpu}}\nprompt_length: 32\nresponse_length: 8\n"
        f"rpc: {{auth_token: {TOKEN}, max_samples_per_prompt: 64, grace_s: 120}}\n"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "serve",
            "generation",
            "-c",
            str(conf),
            "--port",
            "0",
            "--metrics-port",
            "0",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = ""
        t0 = time.time()
        while not line.startswith("LISTENING") and time.time() - t0 < 60:
            line = proc.stdout.readline()
        assert line.startswith("LISTENING service=generation"), line
        fields = dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)
        port, metrics_port = int(fields["port"]), int(fields["metrics_port"])
        client = GenerationClient(f"127.0.0.1:{port}", cfg.rpc)
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="rlhf.v1.Generation"))
        assert h.status == health_pb2.HealthCheckResponse.SERVING
        result = {}

        def slow_call():
            try:
                result["r"] = client.generate([[1, 4, 5, 6, 30]] * 256, SamplingParams(n=64, max_new_tokens=8))
            except grpc.RpcError as e:
                result["e"] = e

        t = threading.Thread(target=slow_call)
        t.start()
        _wait_in_flight(metrics_port, "Generate")  # the server is working on it
        proc.send_signal(signal.SIGTERM)
        t.join(timeout=120)
        assert "r" in result, result.get("e")
        assert len(result["r"].completions) == 256 and all(len(c) == 64 for c in result["r"].completions)
        assert proc.wait(timeout=120) == 0
        with pytest.raises(grpc.RpcError) as e:
            client.info()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")
def test_tls(cfg, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    tls_cfg = config_from_dict(
        {**cfg.model_dump(), "rpc": {**cfg.rpc.model_dump(), "tls_cert_file": str(cert), "tls_key_file": str(key)}}
    )
    with serve(on_free_ports(tls_cfg, "generation")) as svc:
        srv = svc.server
        secure = GenerationClient(f"localhost:{srv.port}", tls_cfg.rpc)
        assert secure.info().vocab_size > 0
        plain = GenerationClient(f"localhost:{srv.port}", cfg.rpc, timeout_s=3)
        with pytest.raises(grpc.RpcError) as e:
            plain.info()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_generated_stubs_match_the_protos():
    r = subprocess.run(
        [sys.executable, "-m", "services.common.rpc.build_protos", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr
