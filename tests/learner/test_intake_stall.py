"""A stuck stale-drop loop is reported: when every trajectory is dropped as stale (the generation
servers do not serve the learner's weights, or serve weights it never pushed), the intake says so
in one error line per doubling of the streak, with the reason, and counts it for the status."""

import logging
import threading

from services.common.config import config_from_dict
from services.common.rpc.gen import replay_pb2 as rpb
from services.learner.intake import TrajectoryIntake


class _Store:
    """Stands in for the Redis store: hands out the same stale group forever."""

    def __init__(self, policy_version: int):
        self.policy_version, self.discarded = policy_version, 0

    def read_trajectories(self, count, block_ms=0, pending=False):
        g = rpb.TrajectoryGroup(policy_version=self.policy_version, task=rpb.PromptTask(uid=f"0:p{self.discarded}"))
        return [(f"{self.discarded}-0".encode(), g)]

    def trained_among(self, uids):
        return [False] * len(uids)

    def discard(self, entry_id, refeed=None):
        self.discarded += 1


class _Feeder:
    def replace_dead_letters(self, policy_version):
        return 0


def _collect_until(intake, drops: int):
    stop = threading.Event()
    orig = intake.store.discard

    def discard(entry_id, refeed=None):
        orig(entry_id, refeed)
        if intake.store.discarded >= drops:
            stop.set()

    intake.store.discard = discard
    assert intake.collect(policy_version=10, stop_event=stop) is None


def test_a_streak_of_stale_drops_is_reported_with_its_reason(caplog):
    cfg = config_from_dict({"rollout_batch_size": 4, "max_staleness": 0})
    intake = TrajectoryIntake(cfg, _Store(policy_version=3), _Feeder())
    with caplog.at_level(logging.ERROR, logger="services.learner.intake"):
        _collect_until(intake, 100)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    # at 16, 32 and 64 drops in a row: not one line per drop
    assert [int(m.split()[1]) for m in errors] == [16, 32, 64], errors
    assert "do not get the learner's pushes" in errors[0]
    assert intake.stale_streak == 100 and intake.counters["dropped_stale"] == 100


def test_trajectories_from_the_future_name_a_rogue_writer(caplog):
    cfg = config_from_dict({"rollout_batch_size": 4, "max_staleness": 0})
    intake = TrajectoryIntake(cfg, _Store(policy_version=2**63 - 1), _Feeder())
    with caplog.at_level(logging.ERROR, logger="services.learner.intake"):
        _collect_until(intake, 20)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "AHEAD of the learner" in errors[0]


def test_a_group_without_critic_values_is_dropped_from_a_run_with_a_critic(caplog):
    """A worker that runs another config (no critic) writes groups without values: a run that
    trains a critic drops them as malformed, with why, instead of failing the batch."""
    from services.common.replay.records import group_to_proto, make_task, task_record
    from services.common.types import Completion, PromptRecord, SampleGroup, ScoreResult

    cfg = config_from_dict({"rollout_batch_size": 1, "adv_estimator": "gae"})

    class Store(_Store):
        def read_trajectories(self, count, block_ms=0, pending=False):
            task = make_task(
                PromptRecord(f"p{self.discarded}", "x="), 0, policy_version=10, min_version=10, group_size=1
            )
            g = SampleGroup(
                task.uid, task_record(task), [1, 2], [Completion([5], [-0.5], "stop")], [ScoreResult(1.0, {})], None, 10
            )
            return [(f"{self.discarded}-0".encode(), group_to_proto(g, task, worker="w", server="s"))]

    intake = TrajectoryIntake(cfg, Store(policy_version=10), _Feeder())
    with caplog.at_level(logging.ERROR, logger="services.learner.intake"):
        _collect_until(intake, 3)
    assert intake.counters["malformed"] == 3
    assert any("no critic values" in r.getMessage() for r in caplog.records)
