"""The learner's gauges and counters from one iteration's metrics dict: what an operator's
dashboard shows (clip fraction, entropy, each phase's seconds, tokens/s, reward range), counters
that follow the service's running totals, and the prompt-queue poller that keeps a scrape off
Redis and keeps its last numbers while Redis is away."""

import math
import threading
import time

from prometheus_client import CollectorRegistry

from services.learner.metrics import PHASES, LearnerMetrics, ReplayPoller, phase_seconds


def _value(registry, name, **labels):
    return registry.get_sample_value(name, {"service": "learner", **labels})


def test_phase_seconds_from_the_time_keys():
    m = {
        "time/wait_s": 0.5,
        "time/train_s": 1.25,
        "time/push_s": 0.125,
        "time/iteration_s": 2.0,
        "time/generate_s": 0.25,
        "reward/score_mean": 1.0,
    }
    assert phase_seconds(m) == {"wait": 0.5, "train": 1.25, "push": 0.125, "eval": 0.0, "generate": 0.25}
    assert phase_seconds({}) == {p: 0.0 for p in PHASES}


def test_observe_sets_every_gauge_from_the_iteration():
    registry = CollectorRegistry()
    metrics = LearnerMetrics(registry)
    m = {
        "reward/score_mean": 0.75,
        "reward/score_min": 0.0,
        "reward/score_max": 2.0,
        "ppo/kl_ref": 0.01,
        "ppo/pg_clipfrac": 0.125,
        "ppo/entropy_rollout": 1.5,
        "rollout/tokens_per_s": 900.0,
        "replay/staleness_mean": 0.5,
        "replay/backlog": 3,
        "time/wait_s": 0.25,
        "time/train_s": 1.0,
        "time/push_s": 0.125,
        "time/eval_s": 0.5,
        "time/iteration_s": 1.875,
        "eval/reward_mean": 1.25,
        "policy/version": 8,
    }
    metrics.observe(7, m, {"dropped_stale": 2, "duplicates": 1})
    expected = {
        "rlhf_learner_iteration": 7,
        "rlhf_learner_policy_version": 8,
        "rlhf_learner_reward": 0.75,
        "rlhf_learner_reward_min": 0.0,
        "rlhf_learner_reward_max": 2.0,
        "rlhf_learner_eval_reward": 1.25,
        "rlhf_learner_kl": 0.01,
        "rlhf_learner_clip_fraction": 0.125,
        "rlhf_learner_entropy": 1.5,
        "rlhf_learner_generation_tokens_per_second": 900.0,
        "rlhf_replay_staleness": 0.5,
        "rlhf_replay_lag": 3,
        "rlhf_learner_push_seconds": 0.125,
        "rlhf_learner_iteration_seconds": 1.875,
        "rlhf_replay_dropped_stale_total": 2,
        "rlhf_replay_duplicates_total": 1,
        "rlhf_replay_malformed_total": 0,
        "rlhf_replay_dead_letters_total": 0,
    }
    assert {k: _value(registry, k) for k in expected} == expected
    assert {p: _value(registry, "rlhf_learner_phase_seconds", phase=p) for p in PHASES} == {
        "wait": 0.25,
        "train": 1.0,
        "push": 0.125,
        "eval": 0.5,
    }
    # the next iteration: no eval (its phase drops to 0, the eval reward stays), counters move by the difference
    metrics.observe(
        8,
        {"reward/score_mean": float("nan"), "time/train_s": 2.0},
        {"dropped_stale": 5, "duplicates": 1, "dead_letters": 1},
    )
    assert _value(registry, "rlhf_learner_phase_seconds", phase="eval") == 0.0
    assert _value(registry, "rlhf_learner_eval_reward") == 1.25
    assert math.isnan(_value(registry, "rlhf_learner_reward"))
    assert _value(registry, "rlhf_replay_dropped_stale_total") == 5
    assert _value(registry, "rlhf_replay_dead_letters_total") == 1


def test_the_hacking_gauge_and_the_queue():
    registry = CollectorRegistry()
    metrics = LearnerMetrics(registry)
    assert _value(registry, "rlhf_learner_reward_hacking") == 0
    metrics.suspected(True)
    assert _value(registry, "rlhf_learner_reward_hacking") == 1
    metrics.queue(12, 4)
    assert (_value(registry, "rlhf_replay_prompts_waiting"), _value(registry, "rlhf_replay_prompts_pending")) == (12, 4)


def test_the_poller_reads_in_the_background_and_keeps_the_last_numbers_on_failure():
    reads = iter([(5, 1), ConnectionError("redis restarting"), (3, 0)])
    seen, got_two = [], threading.Event()

    def read():
        r = next(reads, (3, 0))
        if isinstance(r, Exception):
            raise r
        return r

    def update(waiting, pending):
        seen.append((waiting, pending))
        if len(seen) >= 2:
            got_two.set()

    poller = ReplayPoller(read, update, every_s=0.01).start()
    assert got_two.wait(5)
    poller.stop()
    assert seen[:2] == [(5, 1), (3, 0)]  # the failed read in between changed nothing
    n = len(seen)
    time.sleep(0.05)
    assert len(seen) == n  # stopped
