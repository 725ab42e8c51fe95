"""`rlhf up`'s supervisor (services/launcher.py) and shutdown: once the shutdown began, nothing is
restarted, not even the embedded Redis that exited with code 0 because it was told to stop
(issue 24: "redis exited with code 0; restarting it" during shutdown); a Redis that crashes
while the run goes on is still restarted; the embedded Redis runs in a session of its own, so a
Ctrl-C in the terminal does not stop it before the learner's final checkpoint."""

import argparse
import os
from pathlib import Path

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
    args = argparse.Namespace(
        run_dir=str(tmp_path / "run"),
        overrides=[],
        config="x.yaml",
        max_restarts=3,
        startup_timeout=5.0,
        workers=0,
        generation_servers=0,
        restart_delay=0.0,
    )
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


class CrashingChild(FakeChild):
    """A service that exits with -9 each time it is started."""

    kind = "generation"

    def __init__(self):
        super().__init__()
        self.proc, self.restart_due, self.starts = FakeProc(-9), None, []
        self.log_path = Path("/nonexistent/gen.log")

    def start(self):
        self.starts.append(True)
        self.proc = FakeProc(-9)
        return self


def test_a_crashed_service_is_restarted_after_the_delay_doubled_each_time(launcher, capsys):
    launcher.args.restart_delay, launcher.args.max_restarts = 10.0, 2
    launcher.redis.proc = FakeProc(None)
    gen = launcher.children["generation-0"] = CrashingChild()
    assert launcher.supervise_once(100.0) is None
    assert gen.starts == []
    assert "generation-0 exited with code -9; restarting it in 10s (1/2)" in capsys.readouterr().out
    assert launcher.supervise_once(109.9) is None and gen.starts == []  # still down
    assert launcher.supervise_once(110.0) is None and gen.starts == [True]  # restarted; it crashes again
    assert launcher.supervise_once(111.0) is None and gen.starts == [True]
    assert "restarting it in 20s (2/2)" in capsys.readouterr().out
    assert launcher.supervise_once(131.0) is None and len(gen.starts) == 2
    assert launcher.supervise_once(132.0) == -9  # past --max-restarts: the run stops
    assert "error: generation-0 exited with code -9; stopping the run" in capsys.readouterr().out


def test_the_embedded_redis_has_a_session_of_its_own(tmp_path):
    from services.common.replay.embedded import EmbeddedRedis

    with EmbeddedRedis(tmp_path / "redis", appendonly=False) as r:
        assert os.getsid(r.proc.pid) == r.proc.pid != os.getsid(0)


def test_a_urls_password_leaves_it_whole_and_the_host_as_written():
    """The password goes to the services in the environment, decoded; the URL keeps its host as
    written (an IPv6 address in brackets, the port, the user, the database)."""
    from services.launcher import split_url_password

    assert split_url_password("redis://:p%40ss%2Fw@[::1]:6390/2") == ("redis://[::1]:6390/2", "p@ss/w")
    assert split_url_password("redis://app:pw@redis.internal/0") == ("redis://app@redis.internal/0", "pw")
    assert split_url_password("redis://[fe80::1]:6379/0") == ("redis://[fe80::1]:6379/0", None)
    assert split_url_password(None) == (None, None)


def test_a_password_with_an_at_sign_reaches_redis(tmp_path, monkeypatch):
    """A real Redis with requirepass "p@ss/w": the URL written percent-encoded, as Redis URLs
    are, is split by the launcher and the services connect with the password from the environment."""
    from services.common.config_sections import ReplayConfig
    from services.common.replay.connection import connect
    from services.common.replay.embedded import EmbeddedRedis
    from services.launcher import split_url_password

    with EmbeddedRedis(tmp_path / "redis", password="p@ss/w", appendonly=False) as r:
        url, password = split_url_password(f"redis://:p%40ss%2Fw@127.0.0.1:{r.port}/0")
        assert password == "p@ss/w" and "p%40" not in url
        monkeypatch.setenv("RLHF_REDIS_PASSWORD", password)
        assert connect(ReplayConfig(url=url)).ping()


def test_a_resp3_url_is_refused_with_what_to_do():
    from pydantic import ValidationError

    from services.common.config_sections import ReplayConfig

    with pytest.raises(ValidationError, match="speaks RESP2"):
        ReplayConfig(url="redis://localhost:6379/0?protocol=3")
    with pytest.raises(ValidationError, match="legacy_responses"):
        ReplayConfig(url="redis://localhost:6379/0?legacy_responses=false")
    assert ReplayConfig(url="redis://localhost:6379/0?protocol=2").url.endswith("protocol=2")
    assert ReplayConfig(url="redis://localhost:6379/0?protocol=02").url.endswith("protocol=02")
