"""The rollout worker against real services: in-process gRPC generation and reward servers, a
real Redis (each test in its own replay namespace). Covers server choice (round robin, the
policy version a prompt needs, avoided servers), retries on a dead server, giving up with the
prompts left pending for another worker, dead letters for prompts a server rejects, and servers
that answer with an older policy than a prompt needs."""

import time

import grpc
import httpx
import pytest

from services.common.replay import ReplayStore
from services.common.replay.records import make_task
from services.common.replay.streams import WORKERS_GROUP
from services.common.types import PromptRecord, SamplingParams
from services.generation.client import GenerationClient
from services.generation.server import serve as serve_generation
from services.rollout.worker import RolloutWorker
from services.training.sources.synthetic import reverse_task
from tests.grpc_helpers import on_free_ports
from tests.rollout.conftest import GROUP, _cfg
from tests.waits import wait_until


def _generation(cfg):
    return serve_generation(on_free_ports(cfg, "generation"))


def _addr(svc) -> str:
    return f"127.0.0.1:{svc.server.port}"


def _feed(store, records, min_version=0):
    store.feed([make_task(r, 0, min_version, min_version, GROUP) for r in records])
    return [f"0:{r.id}" for r in records]


def _claim_all(store, consumer, count):
    """Every prompt in the stream, in batches of `count` (as the worker's loop claims them)."""
    batches = []
    while True:
        entries, _ = store.claim_prompts(consumer, count, block_ms=50)
        if not entries:
            return batches
        batches.append(entries)


def _errors(worker, kind):
    return (
        worker.metrics.registry.get_sample_value("rlhf_rollout_errors_total", {"service": "rollout", "kind": kind})
        or 0.0
    )


def _pending(store, consumer=None):
    info = store.r.xpending(store.prompts, WORKERS_GROUP)
    if consumer is None:
        return int(info["pending"])
    return sum(int(c["pending"]) for c in info["consumers"] if c["name"].decode() == consumer)


def _trajectories(store):
    return store.read_trajectories(1000, block_ms=100)


# ---------------------------------------------------------------------------------------------- server choice
def test_pick_server_round_robin_version_preference_and_avoid(make_cfg):
    cfg = make_cfg()
    store = ReplayStore.from_config(cfg)
    with _generation(cfg) as a, _generation(cfg) as b:
        addr_a, addr_b = _addr(a), _addr(b)
        live = store.live("generation")
        assert set(live) == {addr_a, addr_b}  # each server registered itself, with its policy version
        assert live[addr_a]["policy_version"] == live[addr_b]["policy_version"] == 0
        worker = RolloutWorker(cfg, ReplayStore.from_config(cfg), name="w1")

        picks = [worker.servers.pick(0) for _ in range(6)]
        assert set(picks) == {addr_a, addr_b}
        assert all(p != q for p, q in zip(picks, picks[1:])), picks  # round robin: alternates

        # the learner pushes version 5 to one server and updates its registry entry
        assert _push(a, 5) == 5
        store.heartbeat("generation", addr_a, policy_version=5)
        assert [worker.servers.pick(5) for _ in range(6)] == [addr_a] * 6  # only the server at the version
        assert set(worker.servers.pick(0) for _ in range(6)) == {addr_a, addr_b}  # both qualify for 0

        clock = [1000.0]  # avoidance is timed on a clock the test moves
        worker.servers.clock = lambda: clock[0]
        worker.servers.avoid(addr_a, 1.0)
        # the only server at version 5 is avoided: the other is used (its answer's version decides)
        assert [worker.servers.pick(5) for _ in range(4)] == [addr_b] * 4
        assert [worker.servers.pick(0) for _ in range(4)] == [addr_b] * 4
        worker.servers.avoid(addr_b, 1.0)
        assert worker.servers.pick(0) is None  # every server avoided
        clock[0] += 0.99
        assert worker.servers.pick(0) is None  # not yet
        clock[0] += 0.02
        assert set(worker.servers.pick(0) for _ in range(4)) == {addr_a, addr_b}  # avoidance expires
        assert worker.servers.pick(5) == addr_a


# ---------------------------------------------------------------------------------------------- retries
def test_dead_server_in_registry_is_retried_around(make_cfg):
    cfg = make_cfg()
    store = ReplayStore.from_config(cfg)
    with _generation(cfg) as g:
        # a registered server that is gone (its entry not yet expired); it sorts before the real one,
        # so the worker's first pick is the dead server
        store.heartbeat("generation", "127.0.0.1:1", policy_version=0)
        assert set(store.live("generation")) == {"127.0.0.1:1", _addr(g)}
        worker = RolloutWorker(cfg, ReplayStore.from_config(cfg), name="w1")
        uids = _feed(store, reverse_task("train", 8))
        batches = _claim_all(store, "w1", 2)
        assert sum(len(b) for b in batches) == 8
        produced = sum(worker.process(b) for b in batches)
        assert produced == 8 and worker.produced == 8
        assert store.backlog() == 8
        assert _errors(worker, "unavailable") >= 1  # the dead server's failure was counted
        assert (
            worker.metrics.registry.get_sample_value("rlhf_rollout_groups_produced_total", {"service": "rollout"}) == 8
        )
        groups = _trajectories(store)
        assert sorted(m.task.uid for _, m in groups) == sorted(uids)
        for _, m in groups:
            assert m.generation_server == _addr(g) and m.worker == "w1"
            assert len(m.samples) == GROUP
        # every prompt acknowledged and deleted in the same step that appended its trajectories
        assert _pending(store) == 0 and store.prompt_backlog() == 0
        assert store.read_dead() == []


def test_no_generation_server_gives_up_and_leaves_prompts_pending(make_cfg):
    cfg = make_cfg(replay={"claim_idle_s": 1.0})
    store = ReplayStore.from_config(cfg)
    assert store.live("generation") == {}
    worker = RolloutWorker(cfg, ReplayStore.from_config(cfg), name="w1")
    uids = _feed(store, reverse_task("train", 3))
    entries, reclaimed = store.claim_prompts("w1", 10, block_ms=50)
    assert len(entries) == 3 and reclaimed == 0
    t0 = time.perf_counter()
    assert worker.process(entries) == 0
    elapsed = time.perf_counter() - t0
    tries = cfg.rollout.retries + 1
    assert _errors(worker, "no_generation_server") == tries  # the first try and `retries` retries
    backoff = cfg.rollout.retry_backoff_s
    assert elapsed >= backoff * tries * (tries + 1) / 2 * 0.9  # it backed off between tries
    assert worker.produced == 0 and store.backlog() == 0 and store.read_dead() == []
    # not acknowledged: still pending at w1, and another worker takes them over once they are idle
    assert _pending(store, "w1") == 3 and store.prompt_backlog() == 3
    patient = ReplayStore(store.r, namespace=store.ns, claim_idle_s=60.0)  # a worker that waits a minute
    assert patient.claim_prompts("w2", 10, block_ms=10) == ([], 0)  # not idle long enough yet
    # claim_idle_s (1 s) after the claim, they are taken over
    taken, reclaimed = wait_until(
        lambda: (got := store.claim_prompts("w2", 10, block_ms=50))[1] and got, "the prompts reclaimed", every_s=0
    )
    assert reclaimed == 3
    assert sorted(t.uid for _, t in taken) == sorted(uids)
    assert _pending(store, "w2") == 3 and _pending(store, "w1") == 0


def test_generate_deadline_grows_with_the_work_asked_for(make_cfg):
    cfg = make_cfg()  # rollout.generate_timeout_s null: rpc.timeout_s
    worker = RolloutWorker(cfg, ReplayStore.from_config(cfg), name="w1")
    params = SamplingParams(n=4, max_new_tokens=48)
    per_token = cfg.rollout.generate_timeout_per_token_s
    assert worker.generate_timeout(32, params) == pytest.approx(cfg.rpc.timeout_s + per_token * 32 * 4 * 48)
    cfg = make_cfg(rollout={"generate_timeout_s": 10, "generate_timeout_per_token_s": 0.01})
    worker = RolloutWorker(cfg, ReplayStore.from_config(cfg), name="w1")
    assert worker.generate_timeout(32, params) == pytest.approx(10 + 0.01 * 32 * 4 * 48)


class _Expired(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self):
        return "Deadline Exceeded"


def test_a_generate_past_its_deadline_is_retried_with_the_same_key_and_twice_the_deadline(make_cfg):
    """The retry carries the first attempt's idempotency key (a server still working on the batch
    lets it wait for that work) and twice the deadline (the same one would pass again)."""
    cfg = make_cfg(
        rollout={"retries": 4, "retry_backoff_s": 0.05, "generate_timeout_s": 30, "generate_timeout_per_token_s": 0.5}
    )
    store = ReplayStore.from_config(cfg)
    with _generation(cfg) as g:
        worker = RolloutWorker(cfg, ReplayStore.from_config(cfg), name="w1")
        real = GenerationClient(_addr(g), cfg.rpc)
        calls = []

        class Spy:
            def __getattr__(self, name):
                return getattr(real, name)

            def generate(self, prompts, params, timeout=None, key=None):
                calls.append((len(prompts), timeout, key))
                if len(calls) == 1:
                    raise _Expired()
                return real.generate(prompts, params, timeout=timeout, key=key)

        spy = Spy()
        worker.servers.client = lambda address: spy
        _feed(store, reverse_task("train", 3))
        entries, _ = store.claim_prompts("w1", 10, block_ms=50)
        assert worker.process(entries) == 3
        first = 30 + 0.5 * 3 * GROUP * cfg.response_length
        assert [(n, t) for n, t, _ in calls] == [(3, first), (3, 2 * first)]
        assert calls[0][2] and calls[0][2] == calls[1][2]
        assert _errors(worker, "deadline_exceeded") == 1
        # another batch: another key
        _feed(store, reverse_task("train", 5)[3:])
        entries, _ = store.claim_prompts("w1", 10, block_ms=50)
        assert worker.process(entries) == 2
        assert calls[-1][1] == 30 + 0.5 * 2 * GROUP * cfg.response_length and calls[-1][2] != calls[0][2]
        real.close()


# ---------------------------------------------------------------------------------------------- dead letters
def test_rejected_prompt_goes_to_dead_letters_others_are_produced(make_cfg):
    worker_cfg = make_cfg()  # prompt_length 16
    server_cfg = make_cfg(prompt_length=8)
    store = ReplayStore.from_config(worker_cfg)
    good = reverse_task("train", 4)
    bad = PromptRecord("too-long", "abcdefghabcd=", "dcbahgfedcba")  # 14 tokens: fits 16, not 8
    with _generation(server_cfg) as g:
        worker = RolloutWorker(worker_cfg, ReplayStore.from_config(worker_cfg), name="w1")
        assert len(worker.tokenizer(bad.prompt)["input_ids"]) > 8
        assert all(len(worker.tokenizer(r.prompt)["input_ids"]) <= 8 for r in good)
        uids = _feed(store, good[:2] + [bad] + good[2:])
        entries, _ = store.claim_prompts("w1", 10, block_ms=50)
        assert len(entries) == 5
        assert worker.process(entries) == 4
        dead = store.read_dead()
        assert len(dead) == 1
        _, task, error = dead[0]
        assert task.uid == "0:too-long" and task.prompt == bad.prompt
        assert "prompt_length=8" in error, error
        assert worker.metrics.registry.get_sample_value("rlhf_rollout_dead_letters_total", {"service": "rollout"}) == 1
        groups = _trajectories(store)
        assert sorted(m.task.uid for _, m in groups) == sorted(u for u in uids if u != "0:too-long")
        assert all(m.generation_server == _addr(g) for _, m in groups)
        # the bad prompt is acknowledged too: nothing pending, nothing left to reclaim
        assert _pending(store) == 0 and store.prompt_backlog() == 0


# ---------------------------------------------------------------------------------------------- policy version
def _push(svc, policy_version):
    """What the learner does: publish its identity (the fence a registered server checks), raise
    the version counter, push."""
    cfg = svc.servicer.cfg
    run_id, epoch = "test-run", 0
    if cfg.replay.url:
        store = ReplayStore.from_config(cfg)
        epoch = store.new_learner_epoch()
        store.publish_learner("127.0.0.1:1", 0, run_id=run_id, epoch=epoch)
        store.raise_version_to(policy_version)
    client = GenerationClient(_addr(svc), cfg.rpc)
    try:
        return client.update_weights(
            svc.servicer.backend.model.state_dict(), policy_version, run_id=run_id, epoch=epoch
        ).policy_version
    finally:
        client.close()


def test_server_behind_min_version_is_not_used(make_cfg):
    cfg = make_cfg()
    store = ReplayStore.from_config(cfg)
    with _generation(cfg) as old, _generation(cfg) as new:
        assert _push(new, 1) == 1
        store.heartbeat("generation", _addr(new), policy_version=1)  # what the learner does after a push
        live = store.live("generation")
        assert live[_addr(old)]["policy_version"] == 0 and live[_addr(new)]["policy_version"] == 1
        worker = RolloutWorker(cfg, ReplayStore.from_config(cfg), name="w1")
        uids = _feed(store, reverse_task("train", 6), min_version=1)
        batches = _claim_all(store, "w1", 2)
        assert sum(worker.process(b) for b in batches) == 6
        groups = _trajectories(store)
        assert sorted(m.task.uid for _, m in groups) == sorted(uids)
        assert all(m.policy_version >= 1 for _, m in groups), [m.policy_version for _, m in groups]
        assert all(m.generation_server == _addr(new) for _, m in groups)
        assert old.servicer.batcher.batches == 0  # never even asked
        assert store.prompt_backlog() == 0


def test_server_that_missed_a_push_is_avoided_by_its_answer(make_cfg):
    """The registry can be ahead of a server (the learner updates the entry, the push failed):
    the version in the server's answer is the final word; its groups are thrown away and the batch
    is sampled again elsewhere."""
    cfg = make_cfg()
    store = ReplayStore.from_config(cfg)
    with _generation(make_cfg(url=None)) as stale, _generation(cfg) as new:  # `stale` does not register itself
        assert _push(new, 1) == 1
        store.heartbeat("generation", _addr(new), policy_version=1)
        store.heartbeat("generation", _addr(stale), policy_version=1)  # the registry says it has the push; it has not
        worker = RolloutWorker(cfg, ReplayStore.from_config(cfg), name="w1")
        uids = _feed(store, reverse_task("train", 6), min_version=1)
        batches = _claim_all(store, "w1", 2)
        assert len(batches) == 3
        assert sum(worker.process(b) for b in batches) == 6
        groups = _trajectories(store)
        assert sorted(m.task.uid for _, m in groups) == sorted(uids)
        assert all(m.policy_version >= 1 for _, m in groups), [m.policy_version for _, m in groups]
        assert all(m.generation_server == _addr(new) for _, m in groups)
        assert stale.servicer.batcher.batches >= 1  # round robin did send it a batch; its answer was discarded
        assert store.prompt_backlog() == 0 and store.read_dead() == []


# ------------------------------------------------------------------------------ where a failure comes from
def test_a_request_the_server_refuses_as_a_whole_dead_letters_nothing(make_cfg):
    """The worker asks for more new tokens than the server's response_length: that is the
    request (a config mismatch), not any prompt; the prompts stay pending for a server that fits."""
    worker_cfg = make_cfg(response_length=8)
    server_cfg = make_cfg(response_length=4)
    store = ReplayStore.from_config(worker_cfg)
    with _generation(server_cfg) as g:
        worker = RolloutWorker(worker_cfg, ReplayStore.from_config(worker_cfg), name="w1")
        _feed(store, reverse_task("train", 3))
        entries, _ = store.claim_prompts("w1", 10, block_ms=50)
        assert worker.process(entries) == 0
        assert store.read_dead() == []
        assert _pending(store, "w1") == 3  # left pending: reclaimed later
        assert _errors(worker, "invalid_argument") >= 1
        assert _addr(g) in worker.servers.avoided()  # that server is avoided for a while


def test_a_reward_server_failure_does_not_blame_the_generation_server(make_cfg, model_dir):
    cfg = _cfg(
        model_dir,
        make_cfg().replay.url,
        make_cfg().replay.namespace,
        reward_port=1,
        rpc={
            "generation": {"port": 0, "metrics_port": None},
            "reward": {"port": 1, "metrics_port": None, "http_port": None},
            "critic": {"port": 0, "metrics_port": None},
            "dependency_wait_s": 0.5,
            "retry_backoff_s": 0.05,
        },
    )
    store = ReplayStore.from_config(cfg)
    with _generation(cfg) as g:
        worker = RolloutWorker(cfg, ReplayStore.from_config(cfg), name="w1")
        _feed(store, reverse_task("train", 2))
        entries, _ = store.claim_prompts("w1", 10, block_ms=50)
        t0 = time.time()
        assert worker.process(entries) == 0  # no reward: left pending, after waiting for it
        assert time.time() - t0 >= 0.5
        assert _errors(worker, "dependency") == 1
        assert worker.servers.avoided() == {}  # the generation server did its part
        assert g.servicer.batcher.batches >= 1
        assert _pending(store, "w1") == 2 and store.read_dead() == []


# ---------------------------------------------------------------------------------------------- liveness
def test_worker_healthz_follows_its_heartbeats_to_redis(make_cfg, redis_server):
    """/healthz (a container's or pod's liveness probe) is 200 while heartbeats reach Redis, and 503
    once none has for replay.heartbeat_ttl_s: a worker whose loop or Redis link died is restarted."""
    cfg = make_cfg(replay={"heartbeat_ttl_s": 30.0})
    worker = RolloutWorker(cfg, ReplayStore.from_config(cfg), name="probe")
    port = worker.serve_metrics(0)
    url = f"http://127.0.0.1:{port}/healthz"
    try:
        worker.heartbeat()
        assert httpx.get(url, timeout=30).status_code == 200
        assert "probe" in worker.store.live("worker")
        worker.last_heartbeat -= 31.0  # as if none had reached Redis for 31 s
        r = httpx.get(url, timeout=30)
        assert r.status_code == 503 and "no heartbeat reached Redis" in r.text
        worker.heartbeat()
        assert httpx.get(url, timeout=30).status_code == 200
    finally:
        worker.metrics_httpd.stop()
