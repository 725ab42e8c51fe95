"""A finished run stays finished: `finished_run` finds its summary; more iterations continue it."""

import json

from services.learner.checkpoint import finished_run


def _run_dir(tmp_path, summary=None, checkpoints=(), partial=()):
    tmp_path.mkdir(parents=True, exist_ok=True)
    if summary is not None:
        (tmp_path / "summary.json").write_text(summary if isinstance(summary, str) else json.dumps(summary))
    for it in checkpoints:
        d = tmp_path / "checkpoints" / f"iter_{it:06d}"
        d.mkdir(parents=True)
        (d / "learner.pt").write_bytes(b"x")
    for it in partial:  # the critic's half, or a crash before the rename: not complete
        (tmp_path / "checkpoints" / f"iter_{it:06d}" / "critic").mkdir(parents=True)
    return tmp_path


def test_no_summary_is_not_finished(tmp_path):
    assert finished_run(tmp_path / "absent", 5) is None
    assert finished_run(_run_dir(tmp_path, checkpoints=[5]), 5) is None


def test_summary_with_enough_iterations_is_finished(tmp_path):
    summary = {"mode": "distributed", "baseline_eval_reward": 0.1, "final_eval_reward": 0.5, "iterations": 5}
    run = _run_dir(tmp_path, summary, checkpoints=[4, 5])
    assert finished_run(run, 5) == summary
    assert finished_run(str(run), 3) == summary
    assert finished_run(run, 6) is None  # raising run.iterations continues


def test_newest_complete_checkpoint_counts(tmp_path):
    run = _run_dir(tmp_path, {"iterations": 2}, checkpoints=[2, 8], partial=[10])
    assert finished_run(run, 8) == {"iterations": 2}
    assert finished_run(run, 10) is None  # iter_10 has no learner.pt


def test_summary_iterations_count_without_checkpoints(tmp_path):
    assert finished_run(_run_dir(tmp_path, {"iterations": 7}), 7) == {"iterations": 7}


def test_unreadable_summary_is_not_finished(tmp_path):
    assert finished_run(_run_dir(tmp_path, "{not json", checkpoints=[5]), 5) is None
    (tmp_path / "summary.json").write_text("[1, 2]")
    assert finished_run(tmp_path, 1) is None
    assert finished_run(_run_dir(tmp_path / "other", {"iterations": "many"}), 1) is None
