"""`ServerPool`, the one place that chooses a generation server (rollout workers, the learner's
eval and its pushes): round robin preferring the servers at a version, a failed one avoided for a
while, the registry re-read when it is old or a choice needs it. The live-server version of the
worker's choice is tests/rollout/test_worker.py::test_pick_server_round_robin_version_preference_and_avoid."""

import threading
import time

from services.common.config import config_from_dict
from services.generation.client import GenerationClient, ServerPool


class _Registry:
    def __init__(self, servers: dict):
        self.servers, self.reads = servers, 0

    def __call__(self) -> dict:
        self.reads += 1
        return {a: dict(i) for a, i in self.servers.items()}


def _pool(registry, clock):
    return ServerPool(registry, config_from_dict({}).rpc, refresh_s=5.0, clock=lambda: clock[0])


def test_picks_round_robin_at_the_version_and_avoids_a_failed_server():
    registry, clock = _Registry({"a:1": {"version": 3}, "b:1": {"version": 2}, "c:1": {"version": 3}}), [100.0]
    pool = _pool(registry, clock)
    assert [pool.pick(3) for _ in range(4)] == ["a:1", "c:1", "a:1", "c:1"]
    assert {pool.pick(0) for _ in range(6)} == {"a:1", "b:1", "c:1"}
    assert pool.pick(9) in {"a:1", "b:1", "c:1"}  # none at 9: any (its answer's version decides)
    assert pool.pick(9, only_at_version=True) is None
    pool.avoid("a:1", 2.0)
    assert [pool.pick(3) for _ in range(3)] == ["c:1"] * 3 and pool.avoided() == {"a:1": 2.0}
    clock[0] += 2.5
    assert pool.avoided() == {} and {pool.pick(3) for _ in range(4)} == {"a:1", "c:1"}


def test_the_registry_is_read_again_when_old_or_when_no_server_is_at_the_version():
    registry, clock = _Registry({"a:1": {"version": 1}}), [0.0]
    pool = _pool(registry, clock)
    pool.pick(1), pool.pick(1)
    assert registry.reads == 1  # fresh enough
    registry.servers["a:1"]["version"] = 2
    assert pool.pick(2) == "a:1" and registry.reads == 2  # none at 2 in what it had: it looked again
    registry.servers["b:1"] = {"version": 2}
    clock[0] += 6  # older than refresh_s
    assert {pool.pick(2) for _ in range(4)} == {"a:1", "b:1"}
    assert set(pool.live(fresh=True)) == {"a:1", "b:1"}


def test_one_client_per_address():
    pool = _pool(_Registry({}), [0.0])
    try:
        c = pool.client("127.0.0.1:1")
        assert isinstance(c, GenerationClient) and pool.client("127.0.0.1:1") is c
        assert pool.client("127.0.0.1:2") is not c
    finally:
        pool.close()


def test_an_avoided_eval_target_is_used_again_when_its_time_is_up():
    """The learner's eval waits for a server at its version; one it avoided after a failure is
    used again once the avoidance ends (a restarted server at the same address must not be shut
    out for the rest of the wait)."""
    pool = ServerPool(_Registry({"127.0.0.1:1": {"version": 5}}), config_from_dict({}).rpc, refresh_s=5.0)
    pool.avoid("127.0.0.1:1", 0.5)
    ticks = []
    t0 = time.monotonic()
    assert pool.wait_for(5, 30, threading.Event(), on_tick=lambda: ticks.append(1)) == "127.0.0.1:1"
    assert time.monotonic() - t0 >= 0.5 and ticks  # not before its time was up; each look a tick


def test_waiting_for_a_version_no_server_reaches_ends_at_the_timeout_or_the_stop():
    pool = ServerPool(_Registry({"127.0.0.1:1": {"version": 1}}), config_from_dict({}).rpc, refresh_s=5.0)
    assert pool.wait_for(2, 0.3, threading.Event()) is None
    stop = threading.Event()
    stop.set()
    assert pool.wait_for(2, None, stop) is None
