"""DAPO's batch-level fixes (services/training/dapo.py): the soft overlong punishment against its
closed form, through the sampler; dynamic sampling refills a batch that had groups whose rewards
are all equal, in `train --local`'s source and in the learner's intake over a real Redis, and gives
up by its bound with a clear message."""

import logging
import threading

import pytest

from services.common.config import ConfigError, config_from_dict
from services.common.replay import ReplayStore
from services.common.replay.records import group_to_proto, task_record
from services.common.types import Completion, PromptRecord, SampleGroup, SamplingParams, ScoreResult
from services.learner.feeder import PromptFeeder
from services.learner.intake import TrajectoryIntake
from services.local import LocalSource
from services.training.dapo import GroupFilter, informative, overlong_penalty
from services.training.data import EpochSampler
from services.training.sampling import Prompt, ReplySampler, Sampled

RECORDS = [PromptRecord(f"p{i}", f"{i}=", "x") for i in range(12)]
EASY = {"p0", "p1", "p2", "p3", "p4", "p5", "p6"}  # every sample right: rewards all equal


def _group(uid: str, record: PromptRecord) -> SampleGroup:
    rewards = [1.0, 1.0] if record.id in EASY else [1.0, 0.0]
    comps = [Completion([5, 6], [-0.5, -0.5], "stop") for _ in rewards]
    return SampleGroup(uid, record, [1, 2], comps, [ScoreResult(r, {"acc": r}) for r in rewards], None, 0)


def test_the_overlong_penalty_is_dapos_closed_form():
    # budget 20, buffer 8: free up to 12 tokens, then -penalty * (L - 12) / 8, -penalty at 20
    assert [overlong_penalty(n, 20, 8, 1.0) for n in (0, 12, 13, 16, 20)] == pytest.approx(
        [0.0, 0.0, -0.125, -0.5, -1.0]
    )
    assert overlong_penalty(16, 20, 8, 0.5) == pytest.approx(-0.25)
    assert overlong_penalty(20, 20, 0, 1.0) == 0.0  # off


class _Backend:
    """A generation backend that answers a fixed number of tokens per sample (a stand-in: the
    shaping reads lengths only)."""

    def __init__(self, lengths):
        self.lengths = lengths

    def generate(self, prompts, params):
        from services.common.types import GenerationResult

        comps = [[Completion([7] * n, [-0.1] * n, "length") for n in self.lengths] for _ in prompts]
        return GenerationResult(comps, 0, sum(self.lengths) * len(prompts), 0.0)


class _Tok:
    pad_token_id = 0

    def __call__(self, text):
        return {"input_ids": [1, 2]}

    def decode(self, ids, skip_special_tokens=True):
        return "x" * len(ids)


class _Ones:
    def score(self, samples):
        return [ScoreResult(1.0, {"acc": 1.0}) for _ in samples]


def test_the_sampler_adds_the_penalty_to_training_rewards_and_names_it():
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=20)
    sampler = ReplySampler(_Backend([10, 16, 20]), _Ones(), _Tok(), params, overlong=(8, 1.0))
    (group,) = sampler.sample([Prompt(RECORDS[0], "0:p0")]).groups
    assert [s.reward for s in group.scores] == pytest.approx([1.0, 0.5, 0.0])
    assert [s.components["overlong_penalty"] for s in group.scores] == pytest.approx([0.0, -0.5, -1.0])
    plain = ReplySampler(_Backend([10, 16, 20]), _Ones(), _Tok(), params)  # the eval's: no shaping
    out = plain.sample([Prompt(RECORDS[0], "0:p0")])
    assert [r["reward"] for r in out.rows] == [1.0, 1.0, 1.0]
    assert "reward/overlong_penalty" not in out.metrics


def test_a_group_of_equal_rewards_is_not_informative():
    assert not informative(_group("0:p0", RECORDS[0])) and informative(_group("0:p9", RECORDS[9]))
    f = GroupFilter.of(want=2, max_rounds=2)
    f.add([_group("a", RECORDS[0]), _group("b", RECORDS[9])])
    assert f.more() == 1
    f.add([_group("c", RECORDS[1])])
    assert f.more() == 0  # the bound
    assert [g.uid for g in f.batch("iteration 1")] == ["b", "a"]  # informative first, then a filler
    assert f.metrics() == {
        "rollout/equal_groups_frac": pytest.approx(2 / 3),
        "rollout/dynamic_rounds": 2,
        "rollout/equal_groups_trained": 1,
    }


class _RuleSampler:
    """`train --local`'s sampler as the source sees it: groups whose rewards are all equal for the
    EASY prompts (a stand-in for a backend and a rule: the source's logic is under test)."""

    def __init__(self):
        self.calls: list[int] = []

    def sample(self, prompts, score_retries=None):
        self.calls.append(len(prompts))
        return Sampled([_group(p.uid, p.record) for p in prompts], {"time/generate_s": 1.0, "rollout/tokens": 4})

    def close(self):
        pass


def _local(max_rounds: int):
    cfg = config_from_dict(
        {
            "rollout_batch_size": 4,
            "num_return_sequences_in_group": 2,
            "adv_estimator": "grpo",
            "rollout": {"dynamic_sampling": True, "dynamic_sampling_max_rounds": max_rounds},
        }
    )
    sampler = _RuleSampler()
    epochs = EpochSampler(RECORDS, cfg.run.seed)
    epochs.rng.shuffle = lambda order: order.reverse()  # drawn in order (from the end): p0..p6 (easy) first
    return LocalSource(cfg, epochs, sampler), sampler


def test_local_dynamic_sampling_refills_the_batch_with_informative_groups():
    source, sampler = _local(max_rounds=4)
    batch = source.collect(1, 0)
    assert sampler.calls == [4, 4, 3]  # 0 of 4 kept, then 1 of 4, then 3 of 3
    assert len(batch.rollout.response_ids) == 4 * 2
    assert batch.rollout.scores == [1.0, 0.0] * 4  # every group's rewards differ
    assert batch.metrics["rollout/equal_groups_frac"] == pytest.approx(7 / 11)
    assert batch.metrics["rollout/dynamic_rounds"] == 3 and batch.metrics["rollout/equal_groups_trained"] == 0
    assert batch.metrics["time/generate_s"] == pytest.approx(3.0)  # the rounds' seconds summed


def test_local_dynamic_sampling_gives_up_by_its_bound_and_says_so(caplog):
    source, sampler = _local(max_rounds=2)
    with caplog.at_level(logging.WARNING, logger="services.training.dapo"):
        batch = source.collect(1, 0)
    assert sampler.calls == [4, 4]
    assert len(batch.rollout.response_ids) == 4 * 2 and batch.metrics["rollout/equal_groups_trained"] == 3
    (line,) = [r.getMessage() for r in caplog.records if r.name == "services.training.dapo"]
    assert "iteration 1 has 1 of 4 groups with rewards that differ after 2 rounds" in line
    assert "rollout.dynamic_sampling_max_rounds" in line


def test_dynamic_sampling_needs_groups():
    with pytest.raises(ConfigError, match="num_return_sequences_in_group=1 every group is"):
        config_from_dict({"num_return_sequences_in_group": 1, "rollout": {"dynamic_sampling": True}})


@pytest.fixture
def store(redis_server):
    import redis

    s = ReplayStore(redis.Redis.from_url(redis_server.url), namespace="dapo")
    yield s
    s.reset()


def _worker(store, stop: threading.Event) -> None:
    """Stands in for a rollout worker over the real Redis: claims prompts and produces their groups
    (all-equal rewards for the EASY prompts)."""
    while not stop.is_set():
        entries, _ = store.claim_prompts("w", 8, block_ms=100)
        store.produce(
            [(e, group_to_proto(_group(t.uid, task_record(t)), t, worker="w", server="s")) for e, t in entries]
        )


@pytest.mark.parametrize("max_rounds", [4, 1])
def test_the_learner_drops_equal_groups_and_feeds_more_prompts(store, max_rounds, caplog):
    cfg = config_from_dict(
        {
            "rollout_batch_size": 4,
            "num_return_sequences_in_group": 2,
            "adv_estimator": "grpo",
            "rollout": {"dynamic_sampling": True, "dynamic_sampling_max_rounds": max_rounds},
        }
    )
    feeder = PromptFeeder(cfg, store, RECORDS)
    feeder.sampler.rng.shuffle = lambda order: order.reverse()  # p0..p6 (easy) first
    intake = TrajectoryIntake(cfg, store, feeder)
    feeder.feed(1, 0)
    stop = threading.Event()
    worker = threading.Thread(target=_worker, args=(store, stop), daemon=True)
    worker.start()
    try:
        with caplog.at_level(logging.WARNING, logger="services.learner.intake"):
            batch = intake.collect(0, threading.Event())
    finally:
        stop.set()
        worker.join()
    said = [r.getMessage() for r in caplog.records if r.name == "services.learner.intake"]
    ids = sorted(g.record.id for _, g in batch)
    if max_rounds == 4:  # 7 easy dropped, 7 more prompts fed: the batch is p7..p10
        assert ids == ["p10", "p7", "p8", "p9"]
        assert intake.counters["dropped_equal"] == 7 and intake.equal == {"dropped": 7, "trained": 0}
        assert not said
    else:  # no round to spare: the first 4 (all easy) trained, and said
        assert ids == ["p0", "p1", "p2", "p3"] and intake.counters["dropped_equal"] == 0
        assert intake.equal == {"dropped": 0, "trained": 4}
        assert len(said) == 1 and "rollout.dynamic_sampling_max_rounds=1" in said[0]
