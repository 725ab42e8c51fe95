"""Clients ride through a restart: `Retrying` repeats a call while its service is unavailable
(real gRPC over loopback; the server comes up after the first calls failed), says what it waits
for, gives up after `rpc.dependency_wait_s` or when stopped, and never repeats a refused request."""
import threading
import time

import grpc
import pytest

from services.common.config import config_from_dict
from services.common.replay.embedded import free_port
from services.common.rpc.retry import DependencyUnavailable, Retrying
from services.common.types import RewardSample
from services.reward.client import RewardClient
from services.reward.server import serve as serve_reward
from tests.grpc_helpers import on_free_ports
from tests.waits import wait_until


def _cfg(tiny_model_dir, port, **rpc):
    return config_from_dict({"model": {"path": tiny_model_dir, "device": "cpu"},
                             "rpc": {"reward": {"port": port, "metrics_port": None, "http_port": None},
                                     "retry_backoff_s": 0.05, "retry_max_backoff_s": 0.2, **rpc}})


SAMPLE = [RewardSample("abc=", "cba", "cba")]


def test_a_call_waits_for_a_restarting_server_and_says_what_it_waits_for(tiny_model_dir):
    port = free_port()
    cfg = _cfg(tiny_model_dir, port, dependency_wait_s=60)
    waits: list = []
    client = Retrying(RewardClient(f"127.0.0.1:{port}", cfg.rpc), "reward server", cfg.rpc, on_wait=waits.append)
    result: dict = {}
    caller = threading.Thread(target=lambda: result.setdefault("scores", client.score(SAMPLE)))
    caller.start()
    wait_until(lambda: waits, "the call failing (nothing listens yet) and saying what it waits for")
    assert caller.is_alive() and "scores" not in result
    assert waits and waits[-1].startswith(f"waiting for the reward server at 127.0.0.1:{port} (UNAVAILABLE")
    with serve_reward(cfg):  # on the port the client dials (the config's, metrics and HTTP off)
        caller.join(timeout=120)
        assert not caller.is_alive()
    assert result["scores"][0].reward > 0
    assert waits[-1] is None  # answered again: no longer waiting
    client.client.close()


def test_it_gives_up_after_the_wait_or_at_once_when_stopping(tiny_model_dir):
    port = free_port()
    cfg = _cfg(tiny_model_dir, port, dependency_wait_s=0.6)
    client = Retrying(RewardClient(f"127.0.0.1:{port}", cfg.rpc), "reward server", cfg.rpc)
    t0 = time.time()
    with pytest.raises(DependencyUnavailable, match="did not answer score"):
        client.score(SAMPLE)
    assert 0.6 <= time.time() - t0 < 60  # waited dependency_wait_s, then gave up
    stop = threading.Event()
    stop.set()
    stopping = Retrying(RewardClient(f"127.0.0.1:{port}", cfg.rpc), "reward server", cfg.rpc, stop, wait_s=None)
    t0 = time.time()
    with pytest.raises(DependencyUnavailable, match="stopping"):
        stopping.score(SAMPLE)
    assert time.time() - t0 < 30  # at once: no wait of dependency_wait_s (None: for ever)


def test_a_refused_request_is_not_repeated(tiny_model_dir):
    cfg = _cfg(tiny_model_dir, 0)
    with serve_reward(on_free_ports(cfg, "reward")) as svc:
        calls = []
        inner = RewardClient(f"127.0.0.1:{svc.server.port}", cfg.rpc)
        real = inner.score
        inner.score = lambda s: (calls.append(1), real(s))[1]
        client = Retrying(inner, "reward server", cfg.rpc)
        with pytest.raises(grpc.RpcError) as e:
            client.score([])  # an empty batch: INVALID_ARGUMENT
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(calls) == 1
        inner.close()
