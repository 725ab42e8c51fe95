"""What containers rely on: the config file and overrides from the environment ($RLHF_CONFIG,
$RLHF_SET, applied before --set), and `rlhf redis`, the replay buffer's Redis in the foreground."""
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
    return subprocess.run([sys.executable, "-m", "services.cli", "config", "validate", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


def _serve_config(env):
    """The config `rlhf serve` would load, read through its parser (no server is started)."""
    code = ("import sys; from services.cli import build_parser, _load; "
            "a = build_parser().parse_args(sys.argv[1:]); c = _load(a); "
            "print(c.rpc.critic.host, c.replay.url, c.rollout_batch_size, c.model.path)")
    return subprocess.run([sys.executable, "-c", code, "serve", "critic", "--set", "rollout_batch_size=7"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, **env})


def test_rlhf_set_and_rlhf_config_come_from_the_environment():
    env = {"RLHF_CONFIG": "configs/tiny-cpu.yaml",
           "RLHF_SET": "rpc.critic.host=critic\n  replay.url=redis://redis:6379/0 rollout_batch_size=3 model.path=/m"}
    p = _serve_config(env)
    assert p.returncode == 0, p.stderr
    # $RLHF_SET applies, and the command line's --set wins over it
    assert p.stdout.split() == ["critic", "redis://redis:6379/0", "7", "/m"]
    out = yaml.safe_load(_validate("configs/tiny-cpu.yaml", env={"RLHF_SET": "prompt_length=11"}).stdout)
    assert out["prompt_length"] == 11
    bad = _validate("configs/tiny-cpu.yaml", env={"RLHF_SET": "no_such_key=1"})
    assert bad.returncode == 2 and "no_such_key" in bad.stderr


def test_without_rlhf_config_the_config_file_is_required():
    env = {k: v for k, v in os.environ.items() if k != "RLHF_CONFIG"}
    p = subprocess.run([sys.executable, "-m", "services.cli", "serve", "critic"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env=env)
    assert p.returncode == 2 and "-c/--config" in p.stderr


def test_rlhf_redis_serves_with_the_password_and_keeps_an_aof(tmp_path):
    from services.common.replay.embedded import free_port
    port = free_port()
    env = {**os.environ, "RLHF_REDIS_PASSWORD": "pw with space"}
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "redis", "--dir", str(tmp_path), "--host",
                             "127.0.0.1", "--port", str(port)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
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
    p = subprocess.run([sys.executable, "-m", "services.cli", "redis", "--dir", str(tmp_path), "--port", str(port)],
                       env=no_pw, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "RLHF_REDIS_PASSWORD" in p.stderr
