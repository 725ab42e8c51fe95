"""A learner killed at any moment loses no row and no ledger line: the windows a SIGKILL can fall
into between writing a checkpoint and recording what it holds.

Found by the compose run (a `docker kill` mid-checkpoint): its ledger lacked one checkpoint's
prompts, and its metrics lacked one iteration's row."""

import json
from types import SimpleNamespace

import pytest

from services.common.config import config_from_dict
from services.learner.checkpoint import Checkpointer
from services.training.loop import Batch, TrainingLoop
from services.training.runlog import RunLog
from services.training.schedule import Schedule


class Acknowledged:
    """Stands in for the replay store's `commit` (what the checkpointer asks of it): the
    acknowledged (entry, uid) pairs, in order."""

    def __init__(self):
        self.commits: list[list[tuple]] = []

    def commit(self, pairs):
        self.commits.append(list(pairs))


def _ledger(run_dir):
    return [json.loads(x) for x in (run_dir / "trained.jsonl").read_text().splitlines() if x.strip()]


def test_a_crash_between_the_checkpoint_and_its_ledger_line_is_mended_on_load(tmp_path):
    store = Acknowledged()
    ckpt = Checkpointer(tmp_path, store)
    ckpt.save(5, {"iteration": 5}, [(b"1-0", "p:a"), (b"1-1", "p:b")])
    path = ckpt.save(10, {"iteration": 10}, [(b"2-0", "p:c")])
    assert [r["iteration"] for r in _ledger(tmp_path)] == [5, 10]
    # killed after iter_10 was renamed into place, before its line reached the ledger
    (tmp_path / "trained.jsonl").write_text(json.dumps(_ledger(tmp_path)[0]) + "\n")
    state = ckpt.load(path)
    assert state["iteration"] == 10 and store.commits[-1] == [("2-0", "p:c")]
    assert _ledger(tmp_path) == [{"iteration": 5, "uids": ["p:a", "p:b"]}, {"iteration": 10, "uids": ["p:c"]}]
    ckpt.load(path)  # loaded again (a second crash before any new checkpoint): no second line
    assert [r["iteration"] for r in _ledger(tmp_path)] == [5, 10]


def test_a_ledger_line_cut_short_by_the_crash_is_written_again(tmp_path):
    ckpt = Checkpointer(tmp_path, Acknowledged())
    ckpt.save(5, {"iteration": 5}, [(b"1-0", "p:a")])
    path = ckpt.save(10, {"iteration": 10}, [(b"2-0", "p:c")])
    text = (tmp_path / "trained.jsonl").read_text()
    (tmp_path / "trained.jsonl").write_text(text[: text.index("\n") + 12])  # half of line 2
    ckpt.load(path)
    assert _ledger(tmp_path) == [{"iteration": 5, "uids": ["p:a"]}, {"iteration": 10, "uids": ["p:c"]}]


class Killed(BaseException):
    """What a SIGKILL during the checkpoint looks like to the loop: nothing after it runs."""


def test_the_iterations_row_is_written_before_its_checkpoint(tmp_path):
    """Killed while checkpointing iteration 2: its row is in metrics.jsonl, so a run resumed from the
    checkpoint (which keeps rows up to it) has every iteration's row; one resumed from the older
    checkpoint drops it and writes it again."""
    cfg = config_from_dict({"run": {"iterations": 4, "checkpoint_interval": 2, "eval_interval": 0, "log_every": 100}})
    learner = SimpleNamespace(policy_version=0, step=lambda rollout, critic: {"loss": 1.0})
    source = SimpleNamespace(
        wait_metric="time/wait_s",
        data_epoch=0,
        collect=lambda it, policy_version: Batch(
            rollout=None, policy_version=policy_version, metrics={"reward/score_mean": 0.5}
        ),
        trained=lambda batch, it: {},
    )
    sink = SimpleNamespace(publish=lambda learner: (learner.policy_version + 1, {}))

    def checkpoint(it, tick):
        raise Killed

    loop = TrainingLoop(cfg, tmp_path, learner, None, None, source, sink, lambda: {}, checkpoint=checkpoint)
    loop.runlog, loop.baseline = RunLog(tmp_path, cfg, "test"), 0.0
    with pytest.raises(Killed):
        loop.iterate(Schedule(cfg.run))
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2]


def test_a_metrics_row_cut_short_by_the_crash_is_dropped_on_resume(tmp_path):
    cfg = config_from_dict({"run": {"iterations": 4}})
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 0}\n{"iteration": 1}\n{"iteration": 2, "lo')
    log = RunLog(tmp_path, cfg, "test", resume_from=2)
    assert [r["iteration"] for r in log.rows] == [0, 1]
    log.log_iteration(2, {"loss": 1.0})
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]
