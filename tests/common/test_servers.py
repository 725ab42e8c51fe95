"""`ServerPool`, the one place that chooses a generation server (rollout workers, the gateway's
sessions, the learner's eval and its pushes): round robin preferring the servers at a version, a
failed one avoided for a while, the registry re-read when it is old or a choice needs it. The
live-server version of the worker's choice is
tests/rollout/test_worker.py::test_pick_server_round_robin_version_preference_and_avoid.

`Tries` under a `RetryPolicy`, the one retry/avoid policy of those callers: which server next,
how long a failed one is avoided (by `Fault`), the wait between tries, how many tries."""

import threading
import time

import pytest

from services.common.config import config_from_dict
from services.common.servers import BEHIND_PAUSE_S, Fault, RetryPolicy, ServerPool, Tries
from services.generation.client import GenerationClient, generation_clients

RPC = config_from_dict({}).rpc


class _Registry:
    def __init__(self, servers: dict):
        self.servers, self.reads = servers, 0

    def __call__(self) -> dict:
        self.reads += 1
        return {a: dict(i) for a, i in self.servers.items()}


def _pool(registry, clock):
    return ServerPool(registry, generation_clients(RPC), refresh_s=5.0, clock=lambda: clock[0])


def test_picks_round_robin_at_the_version_and_avoids_a_failed_server():
    registry, clock = (
        _Registry({"a:1": {"policy_version": 3}, "b:1": {"policy_version": 2}, "c:1": {"policy_version": 3}}),
        [100.0],
    )
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
    registry, clock = _Registry({"a:1": {"policy_version": 1}}), [0.0]
    pool = _pool(registry, clock)
    pool.pick(1), pool.pick(1)
    assert registry.reads == 1  # fresh enough
    registry.servers["a:1"]["policy_version"] = 2
    assert pool.pick(2) == "a:1" and registry.reads == 2  # none at 2 in what it had: it looked again
    registry.servers["b:1"] = {"policy_version": 2}
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
    pool = ServerPool(_Registry({"127.0.0.1:1": {"policy_version": 5}}), generation_clients(RPC), refresh_s=5.0)
    pool.avoid("127.0.0.1:1", 0.5)
    ticks = []
    t0 = time.monotonic()
    assert pool.wait_for(5, 30, threading.Event(), on_tick=lambda: ticks.append(1)) == "127.0.0.1:1"
    assert time.monotonic() - t0 >= 0.5 and ticks  # not before its time was up; each look a tick


def test_waiting_for_a_version_no_server_reaches_ends_at_the_timeout_or_the_stop():
    pool = ServerPool(_Registry({"127.0.0.1:1": {"policy_version": 1}}), generation_clients(RPC), refresh_s=5.0)
    assert pool.wait_for(2, 0.3, threading.Event()) is None
    stop = threading.Event()
    stop.set()
    assert pool.wait_for(2, None, stop) is None


def test_a_fixed_pool_is_its_one_server():
    pool = ServerPool.fixed("127.0.0.1:7", generation_clients(RPC))
    assert pool.live() == {"127.0.0.1:7": {}} and pool.pick(5) == "127.0.0.1:7"
    assert pool.pick(5, only_at_version=True) is None  # it shows no version


# ---------------------------------------------------------------------------------------------- Tries
class _Stop(threading.Event):
    """A stop event that records the waits asked of it instead of waiting."""

    def __init__(self):
        super().__init__()
        self.waits: list[float] = []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        return self.is_set()


def _tries(servers: dict, policy: RetryPolicy, policy_version=0, first=None):
    clock = [0.0]
    pool = ServerPool(_Registry(servers), lambda a: None, refresh_s=5.0, clock=lambda: clock[0])
    return Tries(pool, policy, policy_version, _Stop(), first=first), pool


def test_a_workers_tries_back_off_doubling_and_avoid_by_fault():
    """The rollout worker's policy: `tries` in all (a try that found no server counts), the
    backoff doubling up to its cap, a failed server avoided for the try's backoff, one that
    refused the request for `refused_s`, one behind the version for `behind_s` and retried soon."""
    policy = RetryPolicy(tries=5, backoff_s=0.5, max_backoff_s=1.5, refused_s=30.0, behind_s=2.0)
    tries, pool = _tries({"a:1": {"policy_version": 1}, "b:1": {"policy_version": 1}}, policy, policy_version=1)
    seen = []
    for address in tries:
        seen.append((tries.attempt, address, tries.backoff_s))
        fault = [Fault.FAILED, Fault.REFUSED, Fault.BEHIND, Fault.ELSEWHERE, Fault.FAILED][tries.attempt]
        tries.failed(address, fault)
    assert [(a, b) for a, _, b in seen] == [(0, 0.5), (1, 1.0), (2, 1.5), (3, 1.5), (4, 1.5)]
    assert [addr for _, addr, _ in seen][:2] == ["a:1", "b:1"]
    assert tries.stop.waits == [0.5, 1.0, BEHIND_PAUSE_S, 1.5, 1.5]
    assert set(tries.tried) == {addr for _, addr, _ in seen if addr is not None}


def test_the_avoidance_each_fault_costs():
    policy = RetryPolicy(backoff_s=0.25, refused_s=30.0, behind_s=2.0)
    for fault, seconds in ((Fault.FAILED, 0.25), (Fault.REFUSED, 30.0), (Fault.BEHIND, 2.0), (Fault.ELSEWHERE, None)):
        tries, pool = _tries({"a:1": {}}, policy)
        address = next(iter(tries))
        tries.failed(address, fault)
        assert pool.avoided() == ({} if seconds is None else {"a:1": seconds}), fault
    tries, pool = _tries({"a:1": {}}, RetryPolicy(avoid_s=10.0))
    tries.failed(next(iter(tries)), Fault.FAILED)
    assert pool.avoided() == {"a:1": 10.0} and tries.stop.waits == [0.0]  # no backoff: straight on


def test_no_server_is_a_try_that_waits_the_backoff():
    tries, _ = _tries({}, RetryPolicy(tries=3, backoff_s=0.1, max_backoff_s=1.0))
    got = []
    for address in tries:
        got.append(address)
        tries.failed(None)
    assert got == [None, None, None] and tries.stop.waits == pytest.approx([0.1, 0.2, 0.4])


def test_a_sessions_tries_start_on_its_server_and_try_each_server_once():
    """The gateway's policy: the session's own server first (avoided or not), then the pool's
    picks; a server that failed is not tried again: once every one has failed, no server (None)."""
    tries, pool = _tries({"a:1": {}, "b:1": {}}, RetryPolicy(avoid_s=0.0, each_once=True), first="b:1")
    got = []
    for address in tries:
        got.append(address)
        if address is None:
            break
        tries.failed(address)
    assert got[0] == "b:1" and set(got[1:-1]) == {"a:1"} and got[-1] is None


def test_an_evals_tries_wait_for_a_server_at_the_version():
    """The learner's eval: only a server at its version, waited for up to `wait_s`; None when
    none came (the caller raises), each look a tick."""
    ticks = []
    pool = ServerPool(_Registry({"a:1": {"policy_version": 1}}), lambda a: None, refresh_s=5.0)
    policy = RetryPolicy(backoff_s=0.0, avoid_s=60.0, only_at_version=True, wait_s=0.3)
    tries = Tries(pool, policy, policy_version=2, on_tick=lambda: ticks.append(1))
    assert next(iter(tries)) is None and ticks
    tries = Tries(pool, policy, policy_version=1)
    it = iter(tries)
    assert next(it) == "a:1"
    tries.failed("a:1")
    assert next(it) is None  # avoided for 60 s, longer than the wait
