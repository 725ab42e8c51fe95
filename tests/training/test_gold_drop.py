"""run.gold_drop: a held-out evaluation that falls more than it below the best so far rolls the
policy back to `best/` (its exact weights, the optimiser's moments dropped, pushed as a new
version) or stops the run, as run.on_gold_drop says. Driven through the training loop's own steps
with the real policy trainer on the tiny model and scripted evaluations."""

import json
import logging

import pytest
import torch

from services.common.config import config_from_dict
from services.learner.trainer import PolicyTrainer
from services.training.loop import TrainingLoop
from services.training.runlog import RunLog


class Sink:
    def __init__(self):
        self.pushed = []

    def publish(self, learner):
        self.pushed.append({k: v.clone() for k, v in learner.policy_state_dict().items()})
        return learner.policy_version + 1, {}


def _loop(model_dir, run_dir, scores, **run):
    cfg = config_from_dict(
        {"model": {"path": model_dir, "device": "cpu"}, "run": {"gold_drop": 0.1, "tensorboard": False, **run}}
    )
    learner = PolicyTrainer(cfg)
    evaluations = iter(scores)
    loop = TrainingLoop(
        cfg, run_dir, learner, None, None, source=None, sink=Sink(),
        evaluate=lambda: {"eval/reward_mean": next(evaluations)},
    )  # fmt: skip
    loop.begin(RunLog(run_dir, cfg, "local"))
    return loop, learner


def _train(learner, seed):
    """Stands in for an update: the weights move, and Adam holds moments."""
    torch.manual_seed(seed)
    for p in learner.policy.parameters():
        p.grad = torch.randn_like(p) * 0.01
    learner.optimizer.step()
    learner.optimizer.zero_grad()


def test_a_fall_past_gold_drop_rolls_the_policy_back_to_the_best(tiny_model_dir, tmp_path, caplog):
    loop, learner = _loop(tiny_model_dir, tmp_path, [0.5, 0.7, 0.65, 0.4])
    _train(learner, 1)
    loop._evaluated(1)  # 0.7: the best, kept in best/
    best = {k: v.clone() for k, v in learner.policy.state_dict().items()}
    _train(learner, 2)
    assert loop._guarded(2, loop._evaluated(2)["eval/reward_mean"]) == {}  # 0.65: within 0.1 of the best
    _train(learner, 3)
    assert learner.optimizer.state
    score = loop._evaluated(3)["eval/reward_mean"]
    with caplog.at_level(logging.WARNING):
        row = loop._guarded(3, score)  # 0.4: 0.3 below the best
    assert row == {"eval/rolled_back": 1, "policy/version": 1}
    now = learner.policy.state_dict()
    assert all(torch.equal(now[k], best[k]) for k in best)  # the best's weights, exactly
    assert not learner.optimizer.state  # its moments pointed away from the best
    assert loop.last["eval"] == 0.7  # what the policy it holds now scored (the summary's final, if it ends here)
    pushed = loop.sink.pushed[-1]
    assert all(torch.equal(pushed[k], best[k]) for k in best)  # and the generation servers got them
    assert any("rolled back to" in r.message and str(tmp_path / "best") in r.message for r in caplog.records)


def test_a_fall_below_the_start_rolls_back_to_the_sft_model(tiny_model_dir, tmp_path):
    loop, learner = _loop(tiny_model_dir, tmp_path, [0.5, 0.2])
    start = {k: v.clone() for k, v in learner.policy.state_dict().items()}
    _train(learner, 1)
    loop._guarded(1, loop._evaluated(1)["eval/reward_mean"])  # no best/ yet: the start is the best
    assert all(torch.equal(learner.policy.state_dict()[k], start[k]) for k in start)


def test_stop_ends_the_run_at_the_fall(tiny_model_dir, tmp_path):
    loop, learner = _loop(tiny_model_dir, tmp_path, [0.5, 0.7, 0.2], on_gold_drop="stop")
    _train(learner, 1)
    loop._evaluated(1)
    _train(learner, 2)
    assert loop._guarded(2, loop._evaluated(2)["eval/reward_mean"]) == {"eval/gold_stop": 1}
    assert "more than run.gold_drop=0.1 below the best 0.7000" in loop.halted
    assert not loop.sink.pushed  # nothing rolled back


def test_rollback_is_refused_where_it_cannot_load_the_best(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="use run.on_gold_drop: stop"):
        _loop(tiny_model_dir, tmp_path, [0.5], save_best=False)


class FakeLearner:
    """Stands in for the policy trainer where the loop's own decisions are under test: its
    'weights' are the iteration it last trained on, and a restore records where it came from."""

    lora = sharded = False

    def __init__(self):
        self.policy_version, self.weights, self.restored = 0, 0, []

    def step(self, rollout, critic=None):
        self.weights += 1
        return {}

    def policy_state_dict(self):
        return {}

    def save_policy(self, path, tokenizer=None):
        path.mkdir(parents=True, exist_ok=True)

    def restore_policy(self, path):
        self.restored.append(path)


class Source:
    wait_metric, data_epoch = "time/wait_s", 0

    def collect(self, iteration, policy_version):
        from services.training.loop import Batch

        return Batch(rollout=None, policy_version=policy_version)

    def trained(self, batch, iteration):
        return {}


def _iterate(tmp_path, scores, **run):
    from services.training.schedule import Schedule

    cfg = config_from_dict(
        {
            "run": {
                "gold_drop": 0.1,
                "tensorboard": False,
                "iterations": len(scores) - 1,
                "eval_interval": 1,
                "checkpoint_interval": 100,
                **run,
            }
        }  # fmt: skip
    )
    evaluations = iter(scores)
    loop = TrainingLoop(
        cfg, tmp_path, FakeLearner(), None, None, source=Source(), sink=Sink(),
        evaluate=lambda: {"eval/reward_mean": next(evaluations)}, checkpoint=lambda it, tick: None,
    )  # fmt: skip
    loop.begin(RunLog(tmp_path, cfg, "local"))
    return loop, *loop.iterate(Schedule(cfg.run))


def test_the_loop_stops_at_the_fall_and_the_run_counts_as_finished(tmp_path):
    from services.learner.checkpoint import finished_run

    loop, last, stopped = _iterate(tmp_path, [0.5, 0.7, 0.3, 0.9, 0.9], on_gold_drop="stop")
    assert (last, stopped) == (2, False) and loop.learner.weights == 2  # no iteration after the fall
    summary = loop.finish(last, 1.0, tmp_path / "critic")
    assert "below the best 0.7000" in summary["halted"]
    assert finished_run(tmp_path, 4) is not None  # a restart does not train past the stop


def test_rollbacks_are_bounded_then_the_run_stops(tmp_path):
    loop, last, _ = _iterate(tmp_path, [0.5, 0.7, 0.3, 0.7, 0.3, 0.7, 0.3, 0.9], max_rollbacks=2)
    assert loop.learner.restored == [tmp_path / "best"] * 2 and loop.rollbacks == 2
    assert last == 6 and loop.halted  # the third fall stopped it
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows if r.get("eval/rolled_back")] == [2, 4]
    assert [r["iteration"] for r in rows if r.get("eval/gold_stop")] == [6]


def test_a_resumed_run_whose_start_was_best_still_guards_it(tiny_model_dir, tmp_path):
    """No best/ was written (the start was the best): a resumed loop knows the best from the baseline."""
    loop, learner = _loop(tiny_model_dir, tmp_path, [0.5, 0.3])
    state = loop.loop_state()
    resumed, learner2 = _loop(tiny_model_dir, tmp_path / "again", [0.3])
    resumed.best = float("-inf")
    resumed.load_loop_state(state)
    resumed.begin(RunLog(tmp_path / "again", resumed.cfg, "local"))
    assert resumed.best == 0.5
    assert resumed._guarded(1, 0.3) == {"eval/rolled_back": 1, "policy/version": 1}
