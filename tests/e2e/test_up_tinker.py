"""`rlhf up --tinker-generation --tinker-trainer` on the tiny model: the Tinker API comes up beside
the run with a generation server and a trainer of its own (its address printed, services.json names
all three), the official SDK trains a step on it while PPO runs (computed by that trainer) and
samples the step's weights on that server, and Ctrl-C stops all three with the rest of the run."""

import json
import math
import os
import queue
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import tinker
import yaml
from tinker import types

from services.common.model_files import load_tokenizer
from tests.e2e.support import up_command, write_train_data
from tests.metrics_helpers import parse_exposition

READY = re.compile(r"tinker API ready on http://127\.0\.0\.1:(\d+)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lines(proc: subprocess.Popen) -> "queue.Queue[str]":
    out: queue.Queue[str] = queue.Queue()

    def pump():
        for line in proc.stdout:
            out.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return out


def _wait_for(lines: "queue.Queue[str]", pattern: re.Pattern, timeout_s: float, seen: list[str]) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            continue
        seen.append(line)
        m = pattern.search(line)
        if m:
            return m
    raise AssertionError("no line matched; the run printed:\n" + "".join(seen[-40:]))


def _counted(metrics_port: int, token: str, name: str, **labels: str) -> float:
    """The counter `name` (its samples with `labels`, summed) a service's /metrics shows; 0 if none."""
    r = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=10)
    assert r.status_code == 200, r.text
    family = parse_exposition(r.text).get(name, {"samples": []})
    return sum(v for n, got, v in family["samples"] if n == name and labels.items() <= got.items())


def test_up_with_tinker_serves_the_sdk_beside_the_run(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    write_train_data(tmp_path / "train.jsonl", 64, seed=0)
    port = _free_port()
    config = tmp_path / "up.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "rollout_batch_size": 4,
                "num_return_sequences_in_group": 2,
                "prompt_length": 32,
                "response_length": 8,
                "model": {"path": tiny_model_dir, "device": "cpu"},
                "data": {"train": str(tmp_path / "train.jsonl")},
                "run": {"iterations": 5000, "eval_interval": 0, "checkpoint_interval": 1000, "seed": 0},
                "tinker": {"port": port, "root": str(tmp_path / "tinker"), "model_name": "tiny"},
            }
        )
    )
    run_dir = tmp_path / "run"
    cmd = up_command(config, run_dir, "--tinker-generation", "--tinker-trainer")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=Path(__file__).resolve().parents[2]
    )
    seen: list[str] = []
    try:
        lines = _lines(proc)
        assert int(_wait_for(lines, READY, 300, seen).group(1)) == port
        secrets = dict(x.split("=", 1) for x in (run_dir / "secrets.env").read_text().split())
        tok = load_tokenizer(tiny_model_dir)
        ids = tok.encode("abc=cba")
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
        )
        key = f"tml-{secrets['RLHF_AUTH_TOKEN']}"
        with tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=key) as sc:
            tc = sc.create_lora_training_client(base_model="tiny", rank=4).result()
            loss = tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
            tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            _wait_for(lines, re.compile(r"rollout worker\(s\) running"), 300, seen)  # services.json written
            services = json.loads((run_dir / "services.json").read_text())["services"]
            own, trainer = services["tinker-generation"], services["tinker-trainer"]
            token = secrets["RLHF_AUTH_TOKEN"]
            # the step was computed by the API's own trainer
            assert _counted(trainer["metrics_port"], token, "rlhf_rpc_requests_total", method="OptimStep") == 1
            assert _counted(trainer["metrics_port"], token, "rlhf_rpc_requests_total", method="ForwardBackward") == 1
            before = _counted(own["metrics_port"], token, "rlhf_generated_tokens_total")
            sampler = tc.save_weights_and_get_sampling_client()
            params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=0)
            seqs = sampler.sample(types.ModelInput.from_ints(ids[:3]), 2, params).result().sequences
            assert len(seqs) == 2 and all(1 <= len(s.tokens) == len(s.logprobs) <= 4 for s in seqs)
            # decoded by the API's own server, not by the run's nor in the API's process
            assert _counted(own["metrics_port"], token, "rlhf_generated_tokens_total") > before
        assert math.isfinite(loss) and loss > 0
        assert services["tinker"]["http_port"] == port and services["learner"]["pid"] != services["tinker"]["pid"]
        assert own["port"] != services["generation-0"]["port"]
        assert proc.poll() is None, "the run ended before it was stopped"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode in (0, 130), "".join(seen[-40:])
    for name in ("tinker", "tinker-generation", "tinker-trainer"):
        try:
            os.kill(services[name]["pid"], 0)
            alive = True
        except ProcessLookupError:
            alive = False
        assert not alive, f"{name} outlived the run"
