"""Experiment tracking: a short in-process run writes TensorBoard event files whose scalars are
metrics.jsonl's numbers at step = iteration, and logs the same rows to Weights & Biases (a fake
`wandb` module stands in: the real one needs an account). W&B asked for but not installed is a
one-line config error; a tracker that fails is dropped and the run goes on; a resumed run hides
the steps it redoes."""

import io
import json
import logging
import sys
import types
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from services.cli import main
from services.common.config import config_from_dict, load_config
from services.local import run_local
from services.training.runlog import RunLog
from services.training.tracking import TB_DIR, redacted, scalars, tracking_errors

ROOT = Path(__file__).resolve().parents[2]


class FakeWandbRun:
    def __init__(self, **init):
        self.init, self.logged, self.finished, self.metrics = init, [], False, {}

    def define_metric(self, name, step_metric=None):
        self.metrics[name] = step_metric

    def log(self, values):
        values = dict(values)
        step = values.pop(self.metrics["*"])  # what W&B plots each value against
        self.logged.append((step, values))

    def finish(self):
        self.finished = True


def fake_wandb_module() -> types.ModuleType:
    """A stand-in for the `wandb` package: records `init`'s arguments and every `log`."""
    fake = types.ModuleType("wandb")
    fake.runs = []

    def init(**kwargs):
        run = FakeWandbRun(**kwargs)
        fake.runs.append(run)
        return run

    fake.init = init
    return fake


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _tensorboard(run_dir: Path) -> dict[str, dict[int, float]]:
    acc = EventAccumulator(str(run_dir / TB_DIR), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_scalars_keeps_the_numbers_of_a_row():
    row = {
        "iteration": 3,
        "wall_s": 1.5,
        "reward/score_mean": 0.25,
        "eval/hacking_suspected": 1,
        "flag": True,
        "missing": None,
        "name": "x",
        "bad": float("nan"),
    }
    assert scalars(row) == {"wall_s": 1.5, "reward/score_mean": 0.25, "eval/hacking_suspected": 1.0, "flag": 1.0}


def test_redacted_hides_the_secrets_only():
    cfg = config_from_dict(
        {
            "rpc": {"auth_token": "s3cret-token"},
            "replay": {"password": "s3cret-pass", "url": "redis://:s3cret-pass@redis:6379/0"},
        }
    )
    out = redacted(cfg.model_dump(mode="json"))
    assert out["rpc"]["auth_token"] == out["replay"]["password"] == "<redacted>"
    assert out["replay"]["url"] == "redis://<redacted>@redis:6379/0"
    assert "s3cret" not in json.dumps(out)
    assert out["rpc"]["max_message_mb"] == 256 and out["rpc"]["learner"]["port"] == 50054
    assert cfg.rpc.auth_token == "s3cret-token"  # the config itself is untouched
    plain = redacted(config_from_dict({}).model_dump(mode="json"))
    assert plain["rpc"]["auth_token"] is None and plain["replay"]["url"] is None


def test_a_short_run_logs_every_row_to_tensorboard_and_wandb(tiny_model_dir, tmp_path, monkeypatch):
    fake = fake_wandb_module()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = load_config(
        ROOT / "configs" / "tiny-cpu.yaml",
        [
            f"model.path={tiny_model_dir}",
            "run.iterations=3",
            "run.eval_interval=2",
            "rollout_batch_size=8",
            "data.eval_size=8",
            "run.wandb_project=rlhf-test",
            "run.wandb_entity=team",
            "run.wandb_mode=offline",
            "rpc.auth_token=s3cret",
        ],
    )
    run_local(cfg, tmp_path)
    rows = _rows(tmp_path)
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3]
    tb = _tensorboard(tmp_path)
    expected = {(k, r["iteration"]): v for r in rows for k, v in scalars(r).items()}
    assert len(expected) > 60 and {"reward/score_mean", "ppo/pg_clipfrac", "eval/reward_mean"} <= set(tb)
    got = {(k, step): v for k, steps in tb.items() for step, v in steps.items()}
    assert set(got) == set(expected)  # every number of every row, at its iteration, and nothing else
    for key, v in expected.items():
        assert got[key] == pytest.approx(v, rel=1e-6, abs=1e-6), key  # float32 in the event file

    (run,) = fake.runs
    assert run.init["project"] == "rlhf-test" and run.init["entity"] == "team" and run.init["mode"] == "offline"
    assert run.init["dir"] == str(tmp_path) and run.init["resume"] == "allow"
    assert run.init["id"] == (tmp_path / "wandb_id").read_text().strip()
    assert run.init["config"]["run"]["iterations"] == 3 and run.init["config"]["rpc"]["auth_token"] == "<redacted>"
    assert run.logged == [(r["iteration"], scalars(r)) for r in rows]
    assert run.finished


def test_wandb_asked_for_but_not_installed_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb fails, as when it is not installed
    cfg = config_from_dict({"run": {"wandb_project": "p"}})
    (error,) = tracking_errors(cfg)
    assert "run.wandb_project" in error and "pip install wandb" in error
    with pytest.raises(ValueError, match="pip install wandb"):
        RunLog(tmp_path, cfg, mode="local")
    with pytest.raises(SystemExit) as e:
        main(["config", "validate", str(ROOT / "configs" / "tiny-cpu.yaml"), "--set", "run.wandb_project=p"])
    assert e.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "pip install wandb" in lines[0] and "Traceback" not in lines[0]
    assert tracking_errors(config_from_dict({})) == []


def test_a_failing_tracker_is_dropped_and_the_run_log_goes_on(tmp_path, monkeypatch, caplog):
    fake = fake_wandb_module()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = config_from_dict({"run": {"wandb_project": "p", "tensorboard": False}})
    log = RunLog(tmp_path, cfg, mode="local", stream=io.StringIO())

    def broken(values):
        raise ConnectionError("wandb is down")

    fake.runs[0].log = broken
    with caplog.at_level(logging.WARNING):
        log.log_iteration(1, {"reward/score_mean": 0.5})
        log.log_iteration(2, {"reward/score_mean": 0.6})
    assert [r["iteration"] for r in _rows(tmp_path)] == [1, 2]
    assert log.sinks == [] and fake.runs[0].finished
    assert sum("wandb tracking failed" in r.message for r in caplog.records) == 1


def test_tensorboard_off_writes_no_event_files(tmp_path):
    log = RunLog(tmp_path, config_from_dict({"run": {"tensorboard": False}}), mode="local", stream=io.StringIO())
    log.log_iteration(1, {"reward/score_mean": 0.5})
    log.close()
    assert not (tmp_path / TB_DIR).exists()


def test_a_resumed_run_hides_the_steps_it_redoes(tmp_path):
    cfg = config_from_dict({})
    quiet = io.StringIO()
    first = RunLog(tmp_path, cfg, mode="local", stream=quiet)
    for it in (1, 2, 3):
        first.log_iteration(it, {"reward/score_mean": float(it)})
    first.close()
    again = RunLog(tmp_path, cfg, mode="local", stream=quiet, resume_from=1)  # resumed from iteration 1's checkpoint
    again.log_iteration(2, {"reward/score_mean": 20.0})
    again.close()
    assert [r["iteration"] for r in _rows(tmp_path)] == [1, 2]
    assert _tensorboard(tmp_path)["reward/score_mean"] == {1: 1.0, 2: 20.0}


def test_a_tracker_that_cannot_start_is_dropped_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    fake = fake_wandb_module()

    def no_key(**kwargs):
        raise RuntimeError("api_key not configured (no-tty)")

    fake.init = no_key
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = config_from_dict({"run": {"wandb_project": "p", "tensorboard": False}})
    with caplog.at_level(logging.WARNING):
        log = RunLog(tmp_path, cfg, mode="local", stream=io.StringIO())
    log.log_iteration(1, {"reward/score_mean": 0.5})
    assert log.sinks == [] and [r["iteration"] for r in _rows(tmp_path)] == [1]
    assert any("wandb tracking could not start" in r.message and "api_key" in r.message for r in caplog.records)


def test_wandb_plots_by_iteration_so_a_resume_keeps_the_redone_iterations(tmp_path, monkeypatch):
    fake = fake_wandb_module()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = config_from_dict({"run": {"wandb_project": "p", "tensorboard": False}})
    first = RunLog(tmp_path, cfg, mode="local", stream=io.StringIO())
    for it in (1, 2, 3):
        first.log_iteration(it, {"reward/score_mean": it / 10})
    again = RunLog(tmp_path, cfg, mode="local", stream=io.StringIO())  # resumed from iteration 2
    again.log_iteration(3, {"reward/score_mean": 0.35})
    assert fake.runs[0].metrics == {"iteration": None, "*": "iteration"} == fake.runs[1].metrics
    assert fake.runs[1].init["id"] == fake.runs[0].init["id"]
    ((step, values),) = fake.runs[1].logged
    assert step == 3 and values["reward/score_mean"] == 0.35  # W&B keeps it, though step 3 was logged before


def test_an_eval_whose_rows_were_all_unscored_says_so_not_0(tmp_path):
    """Iteration 0 printed `eval 0.000` when every held-out row was unscored (issue 54, item 12)."""
    from services.training.evaluate import eval_metrics

    shown = io.StringIO()
    log = RunLog(tmp_path, config_from_dict({"run": {"tensorboard": False}}), mode="local", stream=shown)
    row = {"id": "p", "reward": 0.0, "components": {"failed": 1.0}, "unscored": True}
    log.log_eval(0, eval_metrics([row, {**row, "id": "q"}]))
    log.log_eval(1, eval_metrics([row, {**row, "id": "q", "reward": 1.0, "unscored": False}]))
    log.log_eval(2, eval_metrics([{"id": "p", "reward": 0.25, "components": {}}]))  # a single-turn eval
    log.close()
    lines = shown.getvalue().splitlines()
    assert "eval unscored" in lines[0] and "eval 0.000" not in lines[0]
    assert "eval 0.500 (50% unscored)" in lines[1]
    assert "eval 0.250" in lines[2] and "unscored" not in lines[2]
