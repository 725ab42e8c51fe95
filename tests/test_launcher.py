"""`rlhf up`'s supervisor (services/launcher.py) and shutdown: once the shutdown began, nothing is
restarted, not even the embedded Redis that exited with code 0 because it was told to stop
(issue 24: "redis exited with code 0; restarting it" during shutdown); a Redis that crashes
while the run goes on is still restarted; the embedded Redis runs in a session of its own, so a
Ctrl-C in the terminal does not stop it before the learner's final checkpoint."""
import argparse
import os

import pytest

from services import launcher as launcher_mod
from services.common.config import config_from_dict
from services.launcher import Launcher


class FakeProc:
    def __init__(self, code):
        self.returncode, self.pid = code, 4242

    def poll(self):
        return self.returncode


class FakeChild:
    """A child that stays alive (the learner still checkpointing)."""
    kind = "learner"

    def __init__(self):
        self.proc, self.restarts, self.restarted_at = FakeProc(None), 0, None

    def info(self):
        return {}


class FakeRedis:
    """An embedded Redis whose process has exited (code 0: stopped by a signal)."""
    port, host = 6390, "127.0.0.1"

    def __init__(self, code=0):
        self.proc = FakeProc(code)


@pytest.fixture
def launcher(tmp_path, monkeypatch):
    cfg = config_from_dict({"run": {"run_dir": str(tmp_path / "run")}})
    args = argparse.Namespace(run_dir=str(tmp_path / "run"), overrides=[], config="x.yaml", max_restarts=3,
                              startup_timeout=5.0, workers=0, generation_servers=0)
    up = Launcher(cfg, args)
    up.redis = FakeRedis()
    up.children = {"learner": FakeChild()}
    up.restarted = []
    monkeypatch.setattr(up, "_start_redis", lambda: up.restarted.append("redis"))
    monkeypatch.setattr(up, "write_manifest", lambda: None)
    return up


def test_a_stop_during_the_supervisors_sleep_restarts_nothing(launcher, monkeypatch, capsys):
    def sleep(_s):  # Ctrl-C arrives while the supervisor sleeps; Redis exits with 0 meanwhile
        launcher.stopping.set()
    monkeypatch.setattr(launcher_mod.time, "sleep", sleep)
    assert launcher.supervise() == 130
    assert launcher.restarted == [] and launcher.redis_restarts == 0
    assert "restarting" not in capsys.readouterr().out


def test_redis_is_not_restarted_once_the_shutdown_began(launcher, capsys):
    launcher.stopping.set()
    assert launcher._supervise_redis() is None
    assert launcher.restarted == [] and "restarting" not in capsys.readouterr().out


def test_a_redis_that_crashes_while_the_run_goes_on_is_still_restarted(launcher, capsys):
    launcher.redis = FakeRedis(code=1)
    assert launcher._supervise_redis() is None
    assert launcher.restarted == ["redis"] and launcher.redis_restarts == 1
    assert "redis exited with code 1; restarting it" in capsys.readouterr().out


def test_the_embedded_redis_has_a_session_of_its_own(tmp_path):
    from services.common.replay.embedded import EmbeddedRedis
    with EmbeddedRedis(tmp_path / "redis", appendonly=False) as r:
        assert os.getsid(r.proc.pid) == r.proc.pid != os.getsid(0)

