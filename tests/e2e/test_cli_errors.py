"""The distributed commands fail fast with a clear message when they cannot work."""

import subprocess
import sys


def _rlhf(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_learner_and_worker_without_a_redis_url_exit_2_and_say_what_to_do(tiny_model_dir):
    for service in ("learner", "rollout"):
        p = _rlhf("serve", service, "-c", "configs/tiny-cpu.yaml", "--set", f"model.path={tiny_model_dir}")
        assert p.returncode == 2, (service, p.stdout, p.stderr)
        assert "replay.url is not set" in p.stderr and "rlhf up" in p.stderr


def test_up_without_a_model_says_how_to_build_one(tmp_path):
    p = _rlhf(
        "up",
        "-c",
        "configs/tiny-cpu.yaml",
        "--set",
        f"model.path={tmp_path / 'none'}",
        "--run-dir",
        str(tmp_path / "run"),
    )
    assert p.returncode == 1
    assert "rlhf init-model" in p.stderr or "does not exist" in p.stderr, p.stderr
