"""Asking for a backend gets that backend or a clear error, and GetInfo tells the truth."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.config import config_from_dict
from services.generation.client import GenerationClient
from services.generation.policy import make_backend
from services.generation.server import serve
from tests.grpc_helpers import on_free_ports

ROOT = Path(__file__).resolve().parents[2]


def test_vllm_not_installed_is_a_one_line_error_saying_how_to_install(tiny_model_dir):
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this environment (the vllm-marked tests run its backend)")
    cfg = config_from_dict({"model": {"path": tiny_model_dir}, "generation": {"backend": "vllm"}})
    with pytest.raises(ValueError, match=r"generation.backend: vllm needs vLLM, which is not installed"):
        make_backend(cfg)
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "serve",
            "generation",
            "-c",
            "configs/tiny-cpu.yaml",
            "--set",
            f"model.path={tiny_model_dir}",
            "--set",
            "generation.backend=vllm",
            "--port",
            "0",
            "--metrics-port",
            "-1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2, p.stderr
    assert "pip install '.[vllm]'" in p.stderr and "make vllm-venv" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_get_info_reports_the_engine_that_serves(tiny_model_dir):
    cfg = config_from_dict({"model": {"path": tiny_model_dir, "device": "cpu"}})
    with serve(on_free_ports(cfg, "generation")) as svc:
        info = GenerationClient(f"127.0.0.1:{svc.server.port}", cfg.rpc).info()
    assert info.backend == "hf" and info.engine_version.startswith("transformers ")
    assert info.dtype == "float32" and info.device == "cpu"
