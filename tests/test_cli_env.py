"""What containers rely on: the config file and overrides from the environment ($RLHF_CONFIG,
$RLHF_SET, applied before --set), and `rlhf redis`, the replay buffer's Redis in the foreground."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _validate(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "config", "validate", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def _serve_config(env):
    """The config `rlhf serve` would load, read through its parser (no server is started)."""
    code = (
        "import sys; from services.cli import build_parser, _load; "
        "a = build_parser().parse_args(sys.argv[1:]); c = _load(a); "
        "print(c.rpc.critic.host, c.replay.url, c.rollout_batch_size, c.model.path)"
    )
    return subprocess.run(
        [sys.executable, "-c", code, "serve", "critic", "--set", "rollout_batch_size=7"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


def test_flags_are_overrides_of_config_keys_applied_last(monkeypatch):
    """Each flag of `rlhf serve` sets one key before validation, after $RLHF_SET and --set; -1
    turns a port off (null); the config validate of the same keys prints the same config."""
    from services.cli import _flag_problem, _load, build_parser, flag_overrides
    from services.common.config import dump_config, load_config

    monkeypatch.setenv("RLHF_SET", "rpc.reward.port=7000 run.run_dir=/from-env")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = build_parser().parse_args(
        [
            "serve",
            "reward",
            "-c",
            "configs/tiny-cpu.yaml",
            "--set",
            "rpc.reward.port=7001",
            "--port",
            "7002",
            "--metrics-port",
            "-1",
            "--http-port",
            "0",
            "--host",
            "0.0.0.0",
            "--run-dir",
            "/from-flag",
        ]
    )
    cfg = _load(args)
    ep = cfg.rpc.reward
    assert (ep.port, ep.metrics_port, ep.http_port, ep.host) == (7002, None, 0, "0.0.0.0")
    assert cfg.run.run_dir == "/from-flag" and cfg.rpc.critic.host == "127.0.0.1"
    sets = [
        "rpc.reward.port=7000",
        "run.run_dir=/from-env",
        "rpc.reward.port=7001",
        *(f"{k}={json.dumps(v)}" for k, v in flag_overrides(args)),
    ]
    same = load_config("configs/tiny-cpu.yaml", sets)
    assert dump_config(same) == dump_config(cfg)
    worker = _load(
        build_parser().parse_args(
            ["serve", "rollout", "-c", "configs/tiny-cpu.yaml", "--metrics-port", "9105", "--host", "0.0.0.0"]
        )
    )
    assert (worker.rollout.metrics_port, worker.rpc.host) == (9105, "0.0.0.0")
    learner = _load(build_parser().parse_args(["serve", "learner", "-c", "configs/tiny-cpu.yaml", "--nproc", "2"]))
    assert learner.model.nproc == 2 and learner.critic.nproc == 1
    # a flag the service has no key for is refused in the flag's own words, not as an unknown key
    for argv, words in [
        (["serve", "critic", "--http-port", "1"], "--http-port is for the reward server"),
        (["serve", "rollout", "--port", "1"], "--port: a rollout worker serves no gRPC"),
        (["serve", "reward", "--nproc", "2"], "--nproc is for the learner and the critic"),
        (["serve", "reward", "--metrics-port", "-2"], "--metrics-port -2 is out of range"),
    ]:
        problem = _flag_problem(build_parser().parse_args([*argv, "-c", "configs/tiny-cpu.yaml"]))
        assert problem is not None and problem.startswith(words), (argv, problem)


def test_rlhf_set_and_rlhf_config_come_from_the_environment():
    env = {
        "RLHF_CONFIG": "configs/tiny-cpu.yaml",
        "RLHF_SET": "rpc.critic.host=critic\n  replay.url=redis://redis:6379/0 rollout_batch_size=3 model.path=/m",
    }
    p = _serve_config(env)
    assert p.returncode == 0, p.stderr
    # $RLHF_SET applies, and the command line's --set wins over it
    assert p.stdout.split() == ["critic", "redis://redis:6379/0", "7", "/m"]
    out = yaml.safe_load(_validate("configs/tiny-cpu.yaml", env={"RLHF_SET": "prompt_length=11"}).stdout)
    assert out["prompt_length"] == 11
    bad = _validate("configs/tiny-cpu.yaml", env={"RLHF_SET": "no_such_key=1"})
    assert bad.returncode == 2 and "no_such_key" in bad.stderr
    # a value with spaces, quoted as in a shell
    out = yaml.safe_load(
        _validate(
            "configs/tiny-cpu.yaml",
            env={"RLHF_SET": 'prompt_length=11 data.instruction="Think step by step." run.iterations=5'},
        ).stdout
    )
    assert out["data"]["instruction"] == "Think step by step." and out["run"]["iterations"] == 5
    unclosed = _validate("configs/tiny-cpu.yaml", env={"RLHF_SET": 'data.instruction="Think'})
    assert unclosed.returncode == 2 and "$RLHF_SET: No closing quotation" in unclosed.stderr


def test_without_rlhf_config_the_config_file_is_required():
    env = {k: v for k, v in os.environ.items() if k != "RLHF_CONFIG"}
    p = subprocess.run(
        [sys.executable, "-m", "services.cli", "serve", "critic"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert p.returncode == 2 and p.stderr == "error: give a config file: -c FILE (or set $RLHF_CONFIG)\n"


def test_rlhf_redis_serves_with_the_password_and_keeps_an_aof(tmp_path):
    from services.common.replay.embedded import free_port

    port = free_port()
    env = {**os.environ, "RLHF_REDIS_PASSWORD": "pw with space"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "redis",
            "--dir",
            str(tmp_path),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        r = redis.Redis(port=port, password="pw with space", socket_timeout=2)
        deadline = time.time() + 30
        while True:
            try:
                r.ping()
                break
            except redis.exceptions.ConnectionError:
                assert time.time() < deadline and proc.poll() is None, proc.stdout.read().decode()[-2000:]
                time.sleep(0.1)
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=port, password="wrong").ping()
        r.set("k", "v")
        assert r.config_get("appendonly")["appendonly"] == "yes"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert any(p.name.startswith("appendonly") for p in tmp_path.iterdir())
    # listening beyond loopback without a password is refused
    no_pw = {k: v for k, v in os.environ.items() if k != "RLHF_REDIS_PASSWORD"}
    p = subprocess.run(
        [sys.executable, "-m", "services.cli", "redis", "--dir", str(tmp_path), "--port", str(port)],
        env=no_pw,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and "RLHF_REDIS_PASSWORD" in p.stderr


def test_a_config_name_is_looked_up_in_rlhf_config_path_in_order(tmp_path):
    """Compose's RLHF_CONFIG_PATH=/workspace/configs:/app/configs: the user's workspace copy of a
    config wins over the image's, a name only the image has still loads, a path is a path."""
    workspace, image = tmp_path / "workspace", tmp_path / "image"
    (workspace / "configs").mkdir(parents=True)
    image.mkdir()
    (image / "tiny.yaml").write_text((ROOT / "configs/tiny-cpu.yaml").read_text())
    (image / "only-here.yaml").write_text("prompt_length: 13\n")
    (workspace / "configs" / "tiny.yaml").write_text("prompt_length: 21\n")
    search = f"{workspace / 'configs'}:{image}"
    for name, want in (("tiny.yaml", 21), ("only-here.yaml", 13)):
        out = _validate(name, env={"RLHF_CONFIG_PATH": search})
        assert out.returncode == 0, out.stderr
        assert yaml.safe_load(out.stdout)["prompt_length"] == want, name
    assert (
        yaml.safe_load(_validate(str(image / "tiny.yaml"), env={"RLHF_CONFIG_PATH": search}).stdout)["prompt_length"]
        == 16
    )
    missing = _validate("nowhere.yaml", env={"RLHF_CONFIG_PATH": search})
    assert missing.returncode == 2 and "nowhere.yaml" in missing.stderr


@pytest.mark.parametrize(
    "token, refused",
    [("change-me", "placeholder"), ("Change_Me_Too", "placeholder"), ("s3cret", "6 characters"), ("x" * 16, None)],
)
def test_a_server_beyond_loopback_refuses_placeholder_and_short_secrets(token, refused, tmp_path):
    from services.cli import secret_problem

    problem = secret_problem("RLHF_AUTH_TOKEN", token, "0.0.0.0")
    if refused is None:
        assert problem is None
        return
    assert refused in problem and "RLHF_AUTH_TOKEN" in problem and token not in problem.replace("RLHF_AUTH_TOKEN", "")
    # on the loopback any secret goes (the embedded default, tests)
    assert secret_problem("RLHF_AUTH_TOKEN", token, "127.0.0.1") is None
    # the real command stops before it loads anything, with one line
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "serve",
            "reward",
            "-c",
            "configs/tiny-cpu.yaml",
            "--host",
            "0.0.0.0",
            "--port",
            "0",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "RLHF_AUTH_TOKEN": token},
    )
    assert p.returncode == 2 and p.stderr.startswith("error: RLHF_AUTH_TOKEN") and refused in p.stderr, p.stderr
    p = subprocess.run(
        [sys.executable, "-m", "services.cli", "redis", "--dir", str(tmp_path), "--port", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "RLHF_REDIS_PASSWORD": token},
    )
    assert p.returncode == 2 and "RLHF_REDIS_PASSWORD" in p.stderr and refused in p.stderr, p.stderr


def test_a_backend_not_installed_here_is_a_note_for_validate_and_an_error_for_train(tmp_path):
    """`config validate` often runs away from the GPU box the config is for: vLLM missing here is a
    note; `train --local` would sample here, so it is an error naming generation.backend."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this Python")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    sets = ["--set", "generation.backend=vllm"]
    v = subprocess.run(
        [sys.executable, "-m", "services.cli", "config", "validate", "configs/tiny-cpu.yaml", *sets],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert v.returncode == 0 and "note: generation.backend: vllm is not installed" in v.stderr, v.stderr
    t = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "train",
            "--local",
            "-c",
            "configs/tiny-cpu.yaml",
            *sets,
            "--run-dir",
            str(tmp_path / "run"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert t.returncode == 2 and "generation.backend: vllm is not installed" in t.stderr, t.stderr
