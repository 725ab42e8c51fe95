"""Clients ride through a restart: `RideThrough` repeats a call while its service is unavailable
(real gRPC over loopback; the server comes up after the first calls failed), says what it waits
for, gives up after `rpc.dependency_wait_s` or when stopped, and never repeats a refused request."""

import threading
import time

import grpc
import pytest

from services.common.config import config_from_dict
from services.common.replay.embedded import free_port
from services.common.rpc.retry import DependencyUnavailable, RideThrough
from services.common.types import RewardSample
from services.reward.client import RewardClient
from services.reward.server import serve as serve_reward
from tests.grpc_helpers import on_free_ports
from tests.waits import wait_until


def _cfg(tiny_model_dir, port, **rpc):
    return config_from_dict(
        {
            "model": {"path": tiny_model_dir, "device": "cpu"},
            "rpc": {
                "reward": {"port": port, "metrics_port": None, "http_port": None},
                "retry_backoff_s": 0.05,
                "retry_max_backoff_s": 0.2,
                **rpc,
            },
        }
    )


SAMPLE = [RewardSample("abc=", "cba", "cba")]


def test_a_call_waits_for_a_restarting_server_and_says_what_it_waits_for(tiny_model_dir):
    port = free_port()
    cfg = _cfg(tiny_model_dir, port, dependency_wait_s=60)
    waits: list = []
    address = f"127.0.0.1:{port}"
    client = RewardClient(
        address, cfg.rpc, interceptors=[RideThrough("reward server", address, cfg.rpc, on_wait=waits.append)]
    )
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
    client.close()


def test_it_gives_up_after_the_wait_or_at_once_when_stopping(tiny_model_dir):
    port = free_port()
    cfg = _cfg(tiny_model_dir, port, dependency_wait_s=0.6)
    address = f"127.0.0.1:{port}"
    client = RewardClient(address, cfg.rpc, interceptors=[RideThrough("reward server", address, cfg.rpc)])
    t0 = time.time()
    with pytest.raises(DependencyUnavailable, match="did not answer Score"):
        client.score(SAMPLE)
    assert 0.6 <= time.time() - t0 < 60  # waited dependency_wait_s, then gave up
    stop = threading.Event()
    stop.set()
    stopping = RewardClient(
        address, cfg.rpc, interceptors=[RideThrough("reward server", address, cfg.rpc, stop, wait_s=None)]
    )
    t0 = time.time()
    with pytest.raises(DependencyUnavailable, match="stopping"):
        stopping.score(SAMPLE)
    assert time.time() - t0 < 30  # at once: no wait of dependency_wait_s (None: for ever)


def test_a_refused_request_is_not_repeated(tiny_model_dir):
    cfg = _cfg(tiny_model_dir, 0)
    with serve_reward(on_free_ports(cfg, "reward")) as svc:
        address = f"127.0.0.1:{svc.server.port}"
        client = RewardClient(address, cfg.rpc, interceptors=[RideThrough("reward server", address, cfg.rpc)])
        with pytest.raises(grpc.RpcError) as e:
            client.score([])  # an empty batch: INVALID_ARGUMENT
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        calls = svc.server.metrics.registry.get_sample_value(
            "rlhf_rpc_requests_total", {"service": "reward", "method": "Score", "code": "INVALID_ARGUMENT"}
        )
        assert calls == 1  # asked once: never repeated
        client.close()


def test_an_error_whose_reason_the_caller_handles_is_not_repeated():
    """UNAVAILABLE with `Reason.REWARD_API_FAILED` (the user's reward API failed the batch, the
    reward server is fine): a rollout worker's client (`final=[...]`) gets it at once, to count
    and drop the batch; a client without it waits as for a restarting server."""
    from concurrent import futures

    from services.common.rpc.errors import Reason, Unavailable, reason_of, status_for

    calls = []

    def api_failed(request, context):
        calls.append(1)
        error = Unavailable("reward API failed: HTTP 500", Reason.REWARD_API_FAILED)
        context.abort_with_status(status_for(grpc.StatusCode.UNAVAILABLE, str(error), error))

    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("t.T", {"Score": grpc.unary_unary_rpc_method_handler(api_failed)}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    cfg = config_from_dict({"rpc": {"retry_backoff_s": 0.05, "retry_max_backoff_s": 0.1}})
    address = f"127.0.0.1:{port}"
    try:
        final = grpc.intercept_channel(
            grpc.insecure_channel(address),
            RideThrough("reward server", address, cfg.rpc, wait_s=60, final=[Reason.REWARD_API_FAILED]),
        )
        with pytest.raises(grpc.RpcError) as e:
            final.unary_unary("/t.T/Score")(b"", timeout=30)
        assert reason_of(e.value) is Reason.REWARD_API_FAILED and len(calls) == 1
        waits = grpc.intercept_channel(
            grpc.insecure_channel(address), RideThrough("reward server", address, cfg.rpc, wait_s=0.5)
        )
        with pytest.raises(DependencyUnavailable, match="did not answer Score"):
            waits.unary_unary("/t.T/Score")(b"", timeout=30)
        assert len(calls) > 2  # repeated until it gave up
    finally:
        server.stop(0)
