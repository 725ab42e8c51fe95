"""The learner loop's batch assembly on a real Redis: stale groups are dropped and their
prompts fed again, a prompt is never trained twice, the prompt feed stays `max_staleness`
batches ahead, and a checkpoint acknowledges what it includes and resumes exactly."""

import dataclasses
import json
import logging

import grpc
import pytest

from services.common.config import config_from_dict
from services.common.replay.records import group_to_proto
from services.common.types import Completion, SampleGroup, ScoreResult
from services.learner.run import LearnerLoop


def _cfg(model_dir, url, **over):
    d = {
        "model": {"path": model_dir, "device": "cpu"},
        "adv_estimator": "grpo",
        "num_return_sequences_in_group": 2,
        "rollout_batch_size": 4,
        "prompt_length": 16,
        "response_length": 4,
        "ppo_mini_batch_size": 8,
        "replay": {"url": url, "namespace": "svc", "block_ms": 50},
        "run": {"iterations": 5},
        "rpc": {"learner": {"port": 0, "metrics_port": None, "http_port": None}},
    }
    d.update(over)
    return config_from_dict(d)


@pytest.fixture
def loop(tiny_model_dir, redis_server, tmp_path):
    svc = LearnerLoop(_cfg(tiny_model_dir, redis_server.url, max_staleness=1), tmp_path / "run")
    svc.resume()
    yield svc
    svc.close()


def _produce(store, policy_version: int, n: int, token_versions=None):
    """Play a rollout worker: claim n prompts, answer each with a 2-sample group at `policy_version`
    (its two tokens' versions `token_versions`, when they differ)."""
    claimed, _ = store.claim_prompts("w", n, block_ms=100)
    items = []
    for e, t in claimed:
        g = SampleGroup(
            t.uid,
            None,
            [3, 4],
            [Completion([5, 2], [-1.0, -0.5], "stop", None, token_versions)] * 2,
            [ScoreResult(1.0, {}), ScoreResult(0.0, {})],
            None,
            policy_version,
        )
        items.append((e, group_to_proto(g, t)))
    store.produce(items)
    return [t for _, t in claimed]


def test_feed_runs_max_staleness_batches_ahead(loop):
    feeder = loop.feeder
    feeder.feed(1, 0)
    assert loop.store.prompt_backlog() == 8 and feeder.fed_batches == 2  # batch 1 and, ahead, batch 2
    feeder.feed(1, 0)
    assert loop.store.prompt_backlog() == 8  # idempotent
    feeder.feed(5, 0)
    assert feeder.fed_batches == 5  # never beyond the last iteration


def test_stale_groups_are_dropped_and_fed_again_duplicates_skipped(loop):
    store = loop.store
    loop.feeder.feed(1, 5)  # 8 prompts
    old = _produce(store, policy_version=3, n=2)  # 2 versions behind: too stale for max_staleness=1
    fresh = _produce(store, policy_version=4, n=4)
    # a duplicate of a fresh prompt (say a redelivery after a learner restart) arrives too
    store.feed([fresh[0]])
    dup_task = fresh[0]
    dup_task.attempt = 1
    store.feed([dup_task])
    _produce(store, policy_version=5, n=10)
    batch = loop.intake.collect(5, loop.stop_event)
    uids = [g.uid for _, g in batch]
    assert len(batch) == 4 and len(set(uids)) == 4
    assert loop.counters["dropped_stale"] == 2
    assert loop.counters["duplicates"] == 0  # the 4 fresh groups filled the batch before any copy was read
    # train on them and commit: the same prompts never make it into a batch again
    loop.intake.trained(batch)
    loop.training.iteration = 1
    loop.save_checkpoint()
    assert store.trained_among(uids) == [True] * 4
    ledger = [json.loads(line) for line in (loop.run_dir / "trained.jsonl").read_text().splitlines()]
    assert ledger == [{"iteration": 1, "uids": uids}]
    for t in fresh:  # copies of trained prompts come back (say a learner restart fed them again)
        t.attempt = 7
    store.feed(fresh)
    refed = [t for t in _produce(store, policy_version=5, n=10) if t.attempt == 1]
    assert sorted(t.uid for t in refed) == sorted(o.uid for o in old)
    assert all(t.min_version == 5 for t in refed)
    before = loop.counters["duplicates"]
    second = loop.intake.collect(5, loop.stop_event)
    second_uids = {g.uid for _, g in second}
    assert not second_uids & set(uids)
    assert len(second_uids | set(uids)) == 8  # every prompt fed, each in exactly one batch
    assert loop.counters["duplicates"] > before
    loop.stop_event.set()
    assert loop.intake.collect(5, loop.stop_event) is None  # stopping: no partial batch is returned


def test_checkpoint_resume_restores_learner_and_feed_position(tiny_model_dir, redis_server, tmp_path):
    cfg = _cfg(tiny_model_dir, redis_server.url, max_staleness=0)
    cfg.replay.namespace = "resume"
    a = LearnerLoop(cfg, tmp_path / "run")
    a.resume()
    a.feeder.feed(1, 0)
    a.feeder.feed(2, 0)
    a.training.iteration = 2
    a.learner.kl_ctl.value = 0.123
    a.learner.policy_version = a.store.next_version()
    a.save_checkpoint()
    next_a = [r.id for r in a.feeder.sampler.take(4)]
    a.close()
    assert a.checkpointer.latest().name == "iter_000002"
    _the_format_reads_the_services_checkpoint(tmp_path / "run", a, cfg)
    b = LearnerLoop(cfg, tmp_path / "run")
    assert b.resume() == 2 and b.feeder.fed_batches == 2
    assert b.learner.kl_ctl.value == pytest.approx(0.123)
    assert b.learner.policy_version > a.learner.policy_version  # versions only go forward across restarts
    assert [r.id for r in b.feeder.sampler.take(4)] == next_a
    b.close()


def _the_format_reads_the_services_checkpoint(run_dir, loop, cfg):
    """services/common/checkpoints.py on the files the learner service wrote: its newest
    checkpoint, its mode, its policy (as `rlhf eval` and `rlhf export` load it), and `train
    --local` refused there by name."""
    import torch

    from services.cli.rundir import run_dir_conflict
    from services.common.checkpoints import Mode, mode, newest_checkpoint, policy_weights
    from services.generation.policy import load_policy

    ckpt = newest_checkpoint(run_dir)
    assert ckpt == loop.checkpointer.latest() and mode(ckpt) is Mode.DISTRIBUTED
    policy = loop.learner.policy.state_dict()
    weights = policy_weights(ckpt)
    assert set(weights) == set(policy) and all(torch.equal(weights[k], v) for k, v in policy.items())
    served = load_policy(str(ckpt), cfg.model.path).model.state_dict()
    assert all(torch.equal(served[k], v) for k, v in policy.items())
    problem = run_dir_conflict(
        cfg.model_copy(update={"run": cfg.run.model_copy(update={"run_dir": str(run_dir)})}), Mode.LOCAL
    )
    assert problem is not None and "holds a run of `rlhf up`" in problem


def test_reward_hacking_shows_in_status_metrics_and_the_checkpoint(loop, caplog):
    from services.learner.server import LearnerServicer

    assert loop.status()["reward_hacking"] is None and loop.status()["reward_hacking_suspected"] is False
    rows = []
    with caplog.at_level(logging.WARNING):
        for it, (eval_reward, train_reward) in enumerate([(0.9, 0.1), (0.7, 0.3), (0.5, 0.5)], start=1):
            loop.training.watch.train(train_reward)
            rows.append(loop.training._watched(it, {"eval/reward_mean": eval_reward}))
    assert rows == [{"eval/hacking_suspected": 0}] * 2 + [{"eval/hacking_suspected": 1}]
    (warning,) = [r for r in caplog.records if "reward hacking suspected" in r.message]
    assert warning.levelno == logging.WARNING and "iterations 1..3" in warning.message
    status = loop.status()
    assert status["reward_hacking_suspected"] is True
    assert status["reward_hacking"]["iterations"] == [1, 2, 3] and status["reward_hacking"]["since_iteration"] == 3
    assert json.loads(json.dumps(status, default=str))["reward_hacking"]["eval_change"] == pytest.approx(-0.4)
    assert LearnerServicer(loop).Status(None, None).reward_hacking_suspected is True
    assert loop.metrics.registry.get_sample_value("rlhf_learner_reward_hacking", {"service": "learner"}) == 1
    assert loop.state_dict()["watch"]["last"]["suspected"] is True


class _Failed(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return f"{self._code.name} for the test"


def test_the_eval_skips_a_server_that_failed_it_and_says_when_none_serves_the_version(loop):
    """The learner's eval runs on a server at the current version; one that fails it (a gRPC
    error, or its agent sessions without a server) is avoided for replay.heartbeat_ttl_s and
    another tried; one whose agent service was down is not avoided; a bad request ends the eval;
    no server at the version within rpc.dependency_wait_s: DependencyUnavailable."""
    from services.agents.host import AgentServiceDown
    from services.common.rpc.retry import DependencyUnavailable
    from services.common.servers import ServerPool

    policy_version = loop.learner.policy_version
    registry = {"a:1": {"policy_version": policy_version}, "b:1": {"policy_version": policy_version}}
    loop.servers = ServerPool(lambda: dict(registry), lambda address: None, refresh_s=60.0)
    outcomes = [_Failed(grpc.StatusCode.UNAVAILABLE), AgentServiceDown("down"), {"eval/reward_mean": 0.5}]
    tried = []

    def on(address):
        tried.append(address)
        out = outcomes.pop(0)
        if isinstance(out, Exception):
            raise out
        return out

    loop._evaluate_on = on
    loop.phase.enter("training")
    assert loop.evaluate() == {"eval/reward_mean": 0.5} and loop.state == "training"
    assert tried == ["a:1", "b:1", "b:1"]
    assert set(loop.servers.avoided()) == {"a:1"}  # the agent service's outage is not b's
    assert loop.servers.avoided()["a:1"] == pytest.approx(loop.cfg.replay.heartbeat_ttl_s, abs=1.0)

    outcomes[:] = [_Failed(grpc.StatusCode.INVALID_ARGUMENT)]
    with pytest.raises(grpc.RpcError):
        loop.evaluate()

    registry["b:1"]["policy_version"] = policy_version - 1  # a:1 avoided, b:1 behind: none serves the version
    loop.eval_retry = dataclasses.replace(loop.eval_retry, wait_s=0.3)
    with pytest.raises(DependencyUnavailable, match=f"no generation server serves policy version {policy_version} for"):
        loop.evaluate()


def test_a_group_that_crossed_an_update_is_as_fresh_as_its_newest_token(loop):
    """Version 3 began it, version 4 sampled its last token (an update in flight): at learner
    version 5 with max_staleness 1 it is kept, with each token's version through Redis."""
    store = loop.store
    loop.feeder.feed(1, 5)
    _produce(store, policy_version=3, n=4, token_versions=[3, 4])
    batch = loop.intake.collect(5, loop.stop_event)
    assert len(batch) == 4 and loop.counters["dropped_stale"] == 0
    group = batch[0][1]
    assert group.policy_version == 3 and group.completions[0].token_versions == [3, 4]
