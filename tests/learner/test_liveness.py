"""The learner's liveness means "the training loop is running": /healthz (Kubernetes' liveness
probe, deploy/k8s/base/learner.yaml) and the gRPC health service's "" answer 200 / SERVING while
the loop advances, waiting for rollouts that do not come included (its wait ticks), and 503 /
NOT_SERVING with the reason once it has not advanced for the liveness bound: a loop blocked
inside one call forever. The bound is run.liveness_s, else derived from the configuration."""

import threading
import time

import httpx
import pytest

from services.common.config import config_from_dict
from services.common.replay.connection import redis_worst_s
from services.common.rpc import health
from services.generation.server import serve as serve_generation
from services.learner.liveness import LIVENESS_FLOOR_S, Heartbeat, liveness_bound_s
from services.learner.server import serve as serve_learner
from services.learner.server import status_http
from services.reward.server import serve as serve_reward
from tests.grpc_helpers import on_free_ports


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_the_heartbeat_fails_after_the_bound_without_a_beat_and_not_once_the_loop_ended():
    clock = Clock()
    hb = Heartbeat(30.0, clock=clock)
    hb.beat("waiting")
    clock.t += 29
    assert hb.stuck() is None
    clock.t += 2
    reason = hb.stuck()
    assert reason and "not advanced for 31s (bound 30s" in reason and "phase 'waiting'" in reason
    hb()  # a callback's beat (RideThrough's on_wait, EachAnswer, an on_progress)
    assert hb.stuck() is None and hb.status() == {"phase": "waiting", "since_beat_s": 0.0, "bound_s": 30.0}
    clock.t += 1000
    hb.ended()
    assert hb.stuck() is None


def test_a_client_beats_with_every_answer_and_every_error():
    """`EachAnswer(heartbeat)` on a client's channel (real gRPC over loopback): the heartbeat
    beats when the answer comes, and when the failure does."""
    from concurrent import futures

    import grpc

    from services.common.rpc.retry import EachAnswer
    from services.reward.client import RewardClient  # any client: its channel carries the raw calls

    clock = Clock()
    hb = Heartbeat(10.0, clock=clock)

    def ok(request, context):
        clock.t += 8
        return b"1"

    def fails(request, context):
        clock.t += 8
        context.abort(grpc.StatusCode.INTERNAL, "no")

    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "t.T",
                {"Ok": grpc.unary_unary_rpc_method_handler(ok), "Fails": grpc.unary_unary_rpc_method_handler(fails)},
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = RewardClient(f"127.0.0.1:{port}", config_from_dict({}).rpc, interceptors=[EachAnswer(hb)])
    try:
        assert client.channel.unary_unary("/t.T/Ok")(b"", timeout=30) == b"1"
        clock.t += 5
        assert hb.stuck() is None  # 5 s since the answer, not 13 since the call began
        with pytest.raises(grpc.RpcError):
            client.channel.unary_unary("/t.T/Fails")(b"", timeout=30)
        assert hb.age_s() == 0
    finally:
        client.close()
        server.stop(0)


def test_the_bound_is_configured_or_derived_from_the_waits_the_loop_makes():
    cfg = config_from_dict({})
    assert liveness_bound_s(cfg) == max(LIVENESS_FLOOR_S, 3 * cfg.rpc.timeout_s, redis_worst_s(cfg.replay))
    assert liveness_bound_s(cfg) == LIVENESS_FLOOR_S  # the defaults: 3 x 120 s and ~9 min of Redis retries
    assert redis_worst_s(cfg.replay) < LIVENESS_FLOOR_S
    assert liveness_bound_s(config_from_dict({"rpc": {"timeout_s": 400}})) == 1200
    assert liveness_bound_s(config_from_dict({"run": {"liveness_s": 5}})) == 5


def test_healthz_answers_503_with_the_reason():
    class Service:
        reason = None

        def liveness(self):
            return self.reason

        def status(self):
            return {}

    service = Service()
    httpd = status_http(service, "127.0.0.1", 0, "tok")
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/healthz"
        assert httpx.get(url, timeout=10).json() == {"ok": True}
        service.reason = "the training loop has not advanced for 700s"
        r = httpx.get(url, timeout=10)
        assert r.status_code == 503 and r.json() == {"ok": False, "reason": service.reason}
    finally:
        httpd.shutdown()
        httpd.server_close()


BOUND_S = 6.0  # the loop ticks every 50 ms while it waits: only a 6 s stall of the machine looks stuck


@pytest.fixture
def cfg(tiny_model_dir, redis_server, tmp_path):
    return config_from_dict(
        {
            "model": {"path": tiny_model_dir, "device": "cpu"},
            "adv_estimator": "grpo",
            "num_return_sequences_in_group": 2,
            "rollout_batch_size": 4,
            "prompt_length": 16,
            "response_length": 4,
            "ppo_mini_batch_size": 8,
            "data": {"eval_size": 4},
            "replay": {"url": redis_server.url, "namespace": "liveness", "block_ms": 50, "heartbeat_s": 0.2},
            "run": {"iterations": 3, "run_dir": str(tmp_path / "run"), "liveness_s": BOUND_S},
            "rpc": {"learner": {"port": 0, "metrics_port": None, "http_port": 0}},
        }
    )


def _wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def test_a_waiting_learner_is_alive_and_a_frozen_one_fails_liveness_within_the_bound(cfg):
    with serve_reward(on_free_ports(cfg, "reward")) as reward:
        cfg.rpc.reward.port = reward.server.port
        with serve_generation(on_free_ports(cfg, "generation")), serve_learner(cfg) as learner:
            healthz = f"http://127.0.0.1:{learner.endpoints()['http_port']}/healthz"
            address = f"127.0.0.1:{learner.server.port}"
            service = learner.loop
            result = {}
            loop = threading.Thread(target=lambda: result.setdefault("code", learner.run()))
            loop.start()
            frozen, release = threading.Event(), threading.Event()
            try:
                # no worker runs: the learner waits for trajectories that never come, ticking
                assert _wait_for(lambda: service.state == "waiting", 120), service.state
                waiting_since = time.monotonic()
                while time.monotonic() - waiting_since < 1.5 * BOUND_S:  # longer than the bound: alive throughout
                    r = httpx.get(healthz, timeout=30)
                    assert r.status_code == 200, r.text
                    time.sleep(0.5)
                assert health.status(address, "", timeout_s=30) == "SERVING"

                # the test hook: the next Redis read never returns (a loop blocked inside one call)
                real_read = service.store.read_trajectories

                def blocked(*args, **kwargs):
                    frozen.set()
                    release.wait(120)
                    return real_read(*args, **kwargs)

                service.store.read_trajectories = blocked
                assert frozen.wait(120)
                t_frozen, age = time.monotonic(), service.heartbeat.age_s()  # the last beat: age ago
                assert _wait_for(lambda: httpx.get(healthz, timeout=30).status_code == 503, BOUND_S + 120)
                took = time.monotonic() - t_frozen
                # not before the bound after the last beat (the wait's upper end is only a deadline)
                assert took + age >= BOUND_S - 0.05, (took, age)
                body = httpx.get(healthz, timeout=10).json()
                assert body["ok"] is False and "has not advanced" in body["reason"], body
                assert "phase 'waiting'" in body["reason"]
                assert health.status(address, "", timeout_s=30) == "NOT_SERVING"  # gRPC liveness says the same
                # readiness is another matter
                assert health.status(address, "rlhf.v1.Learner", timeout_s=30) == "SERVING"

                # unblocked, the loop ticks again: alive again
                service.store.read_trajectories = real_read
                release.set()
                assert _wait_for(lambda: httpx.get(healthz, timeout=30).status_code == 200, 120)
                assert health.status(address, "", timeout_s=30) == "SERVING"
            finally:
                release.set()
                learner.drain()
                loop.join(timeout=120)
            assert result == {"code": 0} and service.state == "stopped"
