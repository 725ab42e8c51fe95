"""`rlhf train-rm` on the tiny model: a small separable preference set (the right reversal against a
string of z's) is learned to a high held-out pairwise accuracy; the written directory loads in
the reward server's scorer (`reward.type: model`) and scores exactly what the trainer's forward
gave; reward_stats.json normalises it; the command prints its progress."""

import contextlib
import io
import json

import pytest
import torch

from services.cli import main
from services.common.config import config_from_dict
from services.common.types import RewardSample
from services.reward.scorer import build_scorer
from services.reward_model.train import RewardModel
from services.training.sources.synthetic import reverse_task


def _pairs(path, split, n):
    rows = [{"prompt": r.prompt, "chosen": r.label, "rejected": "z" * len(r.label)} for r in reverse_task(split, n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


@pytest.fixture(scope="module")
def trained(untrained_model_dir, tmp_path_factory):
    """`rlhf train-rm` run once: (its directory, what it printed, the held-out rows)."""
    root = tmp_path_factory.mktemp("rm")
    _pairs(root / "train.jsonl", "train", 64)
    held = _pairs(root / "eval.jsonl", "eval", 24)
    config = root / "rm.yaml"
    config.write_text(
        json.dumps(
            {
                "model": {"path": untrained_model_dir, "device": "cpu"},
                "reward_model": {
                    "train": str(root / "train.jsonl"),
                    "eval": str(root / "eval.jsonl"),
                    "epochs": 3,
                    "batch_size": 8,
                    "micro_batch_size": 4,
                    "lr": 1e-3,
                    "head_lr": 1e-2,
                },
            }
        )
    )
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["train-rm", "-c", str(config), "--out", str(root / "rm")]) == 0
    return root / "rm", printed.getvalue(), held


def test_train_rm_learns_a_separable_set_and_says_so(trained):
    rm_dir, out, _ = trained
    assert "64 training pairs, 24 held out; 3 epoch(s) of 8 steps of 8 pairs" in out
    assert "step   24/24" in out and "held-out (epoch 3): pairwise accuracy" in out
    assert f"reward model written to {rm_dir}" in out
    stats = json.loads((rm_dir / "reward_stats.json").read_text())
    assert stats["held_out_accuracy"] >= 0.9, stats
    assert stats["steps"] == 24 and stats["train_pairs"] == 64 and stats["std"] > 0
    rows = [json.loads(x) for x in (rm_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 25))
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["epoch"] for r in evals] == [0, 1, 2, 3]
    assert evals[-1]["eval/loss"] < evals[0]["eval/loss"] / 2  # learned (a random head may already rank them)
    assert (rm_dir / "curves.png").stat().st_size > 0


def test_the_reward_server_scores_what_the_trainer_gave(trained):
    rm_dir, _, held = trained
    samples = [RewardSample(r["prompt"], r["chosen"], None) for r in held] + [
        RewardSample(r["prompt"], r["rejected"], None) for r in held
    ]
    cfg = config_from_dict({"reward": {"type": "model", "model_path": str(rm_dir)}})
    served = [s.reward for s in build_scorer(cfg.reward, "cpu").score(samples)]
    rm = RewardModel(str(rm_dir))  # the written directory, through the trainer's forward
    with torch.no_grad():
        rm.model.eval()
        trainer = rm.scores([s.prompt + s.response for s in samples]).tolist()
    # the same texts: the scorer batches them 32 + 16, the trainer's forward all 48 at once, so the
    # padding widths differ: float32 noise of another shape, nothing more
    assert served == pytest.approx(trainer, rel=1e-5, abs=1e-5)
    assert all(c > r for c, r in zip(served[: len(held)], served[len(held) :]))  # it prefers the right ones
    stats = json.loads((rm_dir / "reward_stats.json").read_text())
    cfg = config_from_dict({"reward": {"type": "model", "model_path": str(rm_dir), "model_normalize": True}})
    normalised = [s.reward for s in build_scorer(cfg.reward, "cpu").score(samples)]
    assert normalised == pytest.approx([(v - stats["mean"]) / stats["std"] for v in served], rel=1e-5, abs=1e-5)


def test_the_model_scorer_runs_every_forward_on_its_one_compute_thread(trained):
    """Concurrent Score calls (the gRPC server's threads) each get their scores, and the model runs
    on one thread, so the process keeps one OpenMP team instead of one per handler thread."""
    import threading

    rm_dir, _, held = trained
    scorer = build_scorer(config_from_dict({"reward": {"type": "model", "model_path": str(rm_dir)}}).reward, "cpu")
    ran_on: set[str] = set()
    scorer.model.register_forward_hook(lambda *_: ran_on.add(threading.current_thread().name))
    samples = [RewardSample(r["prompt"], r["chosen"], None) for r in held]
    alone = [s.reward for s in scorer.score(samples)]
    results: dict[int, list[float]] = {}
    callers = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, [s.reward for s in scorer.score(samples)]))
        for i in range(3)
    ]
    for t in callers:
        t.start()
    for t in callers:
        t.join(120)
    assert sorted(results) == [0, 1, 2]
    assert all(r == pytest.approx(alone, rel=1e-5, abs=1e-5) for r in results.values())
    assert len(ran_on) == 1 and next(iter(ran_on)).startswith("reward-model"), ran_on
