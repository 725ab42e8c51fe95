"""The replay buffer's contracts on a real Redis: atomic produce-and-acknowledge, no duplicate
trajectories for one prompt attempt, reclaiming a dead consumer's prompts, commit, stale refeed,
backlog, and the liveness registry. Records are protobuf: no pickle."""

import json
import time

import numpy as np
import pytest

from services.common.replay.records import group_from_proto, group_to_proto, make_task, task_record
from services.common.rpc.gen import replay_pb2 as rpb
from services.common.types import Completion, PromptRecord, Rollout, SampleGroup, ScoreResult
from tests.waits import wait_until


def _task(i: int, epoch: int = 0, attempt: int = 0) -> rpb.PromptTask:
    return make_task(
        PromptRecord(f"p{i}", f"abc{i}=", label=f"{i}cba", metadata={"k": i}),
        epoch,
        policy_version=3,
        min_version=3,
        group_size=2,
        attempt=attempt,
    )


def _group(task: rpb.PromptTask, policy_version: int = 3, values: bool = True) -> rpb.TrajectoryGroup:
    comps = [Completion([5, 6, 2], [-0.5, -1.25, -0.125], "stop"), Completion([7], [-2.0], "length")]
    g = SampleGroup(
        task.uid,
        task_record(task),
        [1, 2, 3],
        comps,
        [ScoreResult(1.0, {"exact_match": 1.0}), ScoreResult(0.25, {"exact_match": 0.0})],
        [[0.1, 0.2, 0.3], [0.4]] if values else None,
        policy_version,
    )
    return group_to_proto(g, task, worker="w", server="s:1")


def test_records_round_trip_exactly_and_flatten_into_a_rollout():
    t = _task(1)
    back = group_from_proto(rpb.TrajectoryGroup.FromString(_group(t).SerializeToString()))
    assert back.uid == "0:p1" and back.record.label == "1cba" and back.record.metadata == {"k": 1}
    assert [c.token_ids for c in back.completions] == [[5, 6, 2], [7]]
    assert back.completions[0].log_probs == [-0.5, -1.25, -0.125]  # exact in float32
    assert [s.reward for s in back.scores] == [1.0, 0.25] and back.policy_version == 3
    r = Rollout.from_groups([back, back])
    assert r.index == ["0:p1"] * 4 and r.policy_versions == [3] * 4 and r.scores == [1.0, 0.25, 1.0, 0.25]
    assert [len(v) for v in r.values] == [3, 1, 3, 1]  # one value per response token, padded by the learner
    np.testing.assert_allclose(r.values[0], [0.1, 0.2, 0.3], rtol=1e-6)
    bad = _group(t)
    bad.samples[0].log_probs = bad.samples[0].log_probs[:4]
    with pytest.raises(ValueError, match="log-probs"):
        group_from_proto(bad)


def test_a_batch_with_and_without_critic_values_flattens_without_them():
    """Critic values ride along only when every group has them (a critic-free run ignores those a
    worker sent), whichever group comes first."""
    t = _task(1)
    with_values = group_from_proto(_group(t))
    without = group_from_proto(_group(t, values=False))
    for groups in ([with_values, without], [without, with_values]):
        r = Rollout.from_groups(groups)
        assert r.values is None and len(r.response_ids) == 4


def test_produce_appends_and_acknowledges_atomically_and_once_per_attempt(store):
    store.feed([_task(i) for i in range(3)])
    claimed, reclaimed = store.claim_prompts("w1", 10, block_ms=100)
    assert len(claimed) == 3 and reclaimed == 0
    assert store.r.xpending(store.prompts, "workers")["pending"] == 3
    added = store.produce([(e, _group(t)) for e, t in claimed])
    assert added == [True] * 3
    assert store.r.xpending(store.prompts, "workers")["pending"] == 0 and store.prompt_backlog() == 0
    assert store.backlog() == 3
    # the same attempt again (a reclaimed prompt whose first worker was only slow): nothing appended
    store.feed([_task(0)])
    ((e, t),) = store.claim_prompts("w2", 10, block_ms=100)[0]
    assert store.produce([(e, _group(t))]) == [False]
    assert store.backlog() == 3 and store.prompt_backlog() == 0
    # a re-fed attempt (after a stale drop) is a new attempt and does produce
    store.feed([_task(0, attempt=1)])
    ((e, t),) = store.claim_prompts("w2", 10, block_ms=100)[0]
    assert store.produce([(e, _group(t))]) == [True]
    assert store.backlog() == 4


def _view(store, claim_idle_s: float):
    """The same namespace on the same Redis, with another claim_idle_s (a worker's setting)."""
    from services.common.replay import ReplayStore

    return ReplayStore(store.r, namespace=store.ns, claim_idle_s=claim_idle_s)


def _reclaim(store, consumer: str, count: int) -> tuple[list, int]:
    """Claims until something is reclaimed from another consumer."""
    return wait_until(
        lambda: (got := store.claim_prompts(consumer, count, block_ms=50))[1] and got,
        "prompts reclaimed from another consumer",
        every_s=0,
    )


def test_a_dead_consumers_prompts_are_reclaimed_by_another(store):
    store.feed([_task(i) for i in range(4)])
    taken, _ = store.claim_prompts("doomed", 4, block_ms=100)
    assert len(taken) == 4
    # before claim_idle_s (a minute, for a worker that says so), nothing to reclaim and nothing new
    assert _view(store, claim_idle_s=60).claim_prompts("survivor", 4, block_ms=50) == ([], 0)
    got, reclaimed = _reclaim(store, "survivor", 4)  # claim_idle_s 0.3: soon
    assert reclaimed == 4 and sorted(t.uid for _, t in got) == sorted(t.uid for _, t in taken)
    store.produce([(e, _group(t)) for e, t in got])
    assert store.r.xpending(store.prompts, "workers")["pending"] == 0
    # the doomed worker wakes up late and tries to finish its batch: no duplicate trajectories
    assert store.produce([(e, _group(t)) for e, t in taken]) == [False] * 4
    assert store.backlog() == 4


def test_learner_reads_commits_and_refeeds(store):
    store.feed([_task(i) for i in range(3)])
    claimed, _ = store.claim_prompts("w", 3, block_ms=100)
    store.produce([(e, _group(t, policy_version=i)) for i, (e, t) in enumerate(claimed)])
    got = store.read_trajectories(10, block_ms=100)
    assert len(got) == 3 and store.backlog() == 0 and store.learner_pending() == 3
    # a restarted learner re-reads what it had read and not committed
    assert [e for e, _ in store.read_trajectories(10, pending=True)] == [e for e, _ in got]
    (e0, m0), (e1, m1), (e2, m2) = got
    refeed = rpb.PromptTask()
    refeed.CopyFrom(m0.task)
    refeed.attempt += 1
    store.discard(e0, refeed)  # stale: dropped, prompt fed again in the same transaction
    assert store.prompt_backlog() == 1 and store.learner_pending() == 2
    assert store.trained_among([m1.task.uid, m2.task.uid]) == [False, False]
    store.commit([(e1, m1.task.uid), (e2, m2.task.uid)])
    assert store.learner_pending() == 0 and store.r.xlen(store.trajectories) == 0
    assert store.trained_among([m0.task.uid, m1.task.uid, m2.task.uid]) == [False, True, True]
    store.commit([(e1, m1.task.uid)])  # idempotent (a resumed learner repeats its last commit)
    assert store.trained_count() == 2


def test_dead_letters_are_acknowledged_and_readable(store):
    store.feed([_task(7)])
    ((e, t),) = store.claim_prompts("w", 1, block_ms=100)[0]
    store.dead_letter(e, t, "prompts[0]: 40 tokens, more than prompt_length=32", "w")
    assert store.r.xpending(store.prompts, "workers")["pending"] == 0
    ((entry, task, error),) = store.read_dead()
    assert task.uid == "0:p7" and "prompt_length" in error
    assert store.read_dead(entry) == []


def test_registry_forgets_services_without_a_heartbeat(store, monkeypatch):
    """Ages are measured on the registry's clock (Redis's TIME), here one the test moves."""
    clock = [float(store.now())]
    monkeypatch.setattr(store, "now", lambda: clock[0])
    store.heartbeat("generation", "127.0.0.1:1", policy_version=4)
    store.heartbeat("generation", "127.0.0.1:2", policy_version=4)
    assert set(store.live("generation")) == {"127.0.0.1:1", "127.0.0.1:2"}
    clock[0] += 0.7
    store.heartbeat("generation", "127.0.0.1:2", policy_version=5)
    clock[0] += 0.5  # the first one silent for 1.2 s, past heartbeat_ttl_s = 1.0; the second for 0.5 s
    live = store.live("generation")
    assert set(live) == {"127.0.0.1:2"} and live["127.0.0.1:2"]["policy_version"] == 5
    assert store.r.hlen(store.generation_key) == 1  # the silent one was removed
    assert store.next_version() == 1 and store.next_version() == 2 and store.version() == 2


def test_nothing_in_redis_is_pickled(store):
    store.feed([_task(1)])
    ((e, t),) = store.claim_prompts("w", 1, block_ms=100)[0]
    store.produce([(e, _group(t))])
    for key in (store.trajectories,):
        for _, fields in store.r.xrange(key):
            assert not fields[b"d"].startswith(b"\x80")  # pickle protocol 2+ header
            rpb.TrajectoryGroup.FromString(fields[b"d"])


def test_a_live_consumer_that_renews_its_claim_keeps_its_prompts(store):
    """Renewing every 0.1 s against a claim_idle_s of 3 s: held through four seconds (a renewal
    would have to be late by thirty periods to lose them); once renewal stops, they are reclaimed."""
    from services.rollout.claims import ClaimRenewal as _ClaimRenewal

    other = _view(store, claim_idle_s=3.0)
    store.feed([_task(i) for i in range(3)])
    taken, _ = store.claim_prompts("slow", 3, block_ms=100)
    with _ClaimRenewal(store, "slow", [e for e, _ in taken], every_s=0.1):
        time.sleep(4.0)  # longer than claim_idle_s: without renewal another worker takes them over
        assert other.claim_prompts("other", 3, block_ms=50) == ([], 0)
    got, reclaimed = _reclaim(other, "other", 3)  # the renewal stopped (the worker died)
    assert reclaimed == 3


def test_registry_ignores_registrations_without_proof_of_the_token(store):
    import redis

    from services.common.replay import ReplayStore

    secured = ReplayStore(
        redis.Redis(connection_pool=store.r.connection_pool),
        namespace=store.ns,
        heartbeat_ttl_s=1.0,
        secret="the-token",
    )
    secured.heartbeat("generation", "10.0.0.1:50051", policy_version=1)  # holds the token
    store.heartbeat("generation", "10.6.6.6:50051", policy_version=99)  # Redis access, no token
    rogue = ReplayStore(redis.Redis(connection_pool=store.r.connection_pool), namespace=store.ns, secret="guess")
    rogue.heartbeat("generation", "10.6.6.7:50051", policy_version=99)  # a wrong token
    assert set(secured.live("generation")) == {"10.0.0.1:50051"}
    # a copied proof does not carry over to another address
    raw = json.loads(store.r.hget(store.generation_key, "10.0.0.1:50051"))
    store.r.hset(store.generation_key, "10.6.6.8:50051", json.dumps(raw))
    assert set(secured.live("generation")) == {"10.0.0.1:50051"}


def test_prompt_queue_counts_prompts_not_done_and_those_being_worked_on(store):
    """What an autoscaler of rollout workers reads (Redis 6.2 commands only): waiting = not yet
    delivered + delivered and pending; done prompts (produced or dead-lettered) leave it."""
    assert store.prompt_queue() == (0, 0)
    store.feed([_task(i) for i in range(5)])
    assert store.prompt_queue() == (5, 0)
    claimed, _ = store.claim_prompts("w1", 2, block_ms=100)
    assert store.prompt_queue() == (5, 2)
    store.produce([(claimed[0][0], _group(claimed[0][1]))])
    assert store.prompt_queue() == (4, 1)
    store.dead_letter(claimed[1][0], claimed[1][1], "refused", "w1")
    assert store.prompt_queue() == (3, 0)
    store.claim_prompts("w2", 10, block_ms=100)
    assert store.prompt_queue() == (3, 3)
