"""The learner sharded with FSDP2 across 2 CPU processes (gloo), against one process on the same
batches: the same losses and updated weights, the same full state dict for a push, a sharded
checkpoint that resumes to the same state (in 2 processes, and in 1: resharded), and a final
model that is the trained one."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from services.learner.trainer import PolicyTrainer
from tests.distributed_helpers import torchrun
from tests.learner.fsdp_cases import batches, learner_config

ROOT = Path(__file__).resolve().parents[2]

# two mini-batches per step of 10 rows, or one (the fused old log-probs) in micro-batches;
# 3 rows per mini-batch split 2/1 across the processes, the last mini-batch of 1 row leaves
# rank 1 a weightless micro-batch
CASES = {
    "two-minibatches": ["ppo_mini_batch_size=8"],
    "fused-micro": ["ppo_mini_batch_size=16", "micro_batch_size=2"],
    "uneven": ["ppo_mini_batch_size=3", "actor_lr=0.001"],
}


def _two_processes(model_dir: str, out: Path, overrides: list[str]) -> dict:
    torchrun(ROOT / "tests" / "learner" / "fsdp_worker.py", model_dir, str(out), *overrides)
    return torch.load(out / "results.pt", weights_only=False)


def _one_process(model_dir: str, overrides: list[str], checkpoint: Path) -> tuple[PolicyTrainer, dict]:
    """Step A from the same start as the two processes; step B from the two processes' checkpoint
    after step A (its weights and Adam moments). Continuing from its own step A instead would
    compare two trajectories: Adam turns a near-zero gradient's float noise into a step of up to
    lr (1e-2 here) on some elements, and step B's losses then differ by far more than one step's
    noise (seen: kl_loss 1.5e-3 apart, relative). From one state, each step's difference is that
    step's arithmetic alone."""
    cfg = learner_config(model_dir, overrides)
    torch.manual_seed(0)
    learner = PolicyTrainer(cfg, total_updates=10)
    a, b = batches(learner.pad_id)
    results = {"step_a": learner.step(a)}
    results["weights_a"] = {k: v.clone() for k, v in learner.policy_state_dict().items()}  # not views
    learner = PolicyTrainer(cfg, total_updates=10)
    learner.load_state_dict(torch.load(checkpoint / "learner.pt", weights_only=False), checkpoint / "actor")
    results["step_b"] = learner.step(b)
    results["weights_b"] = {k: v.clone() for k, v in learner.policy_state_dict().items()}
    return learner, results


def _close(got: dict, want: dict, lr: float, steps: int) -> None:
    """Weights equal up to float noise. Adam turns a near-zero gradient's noise into a step of up
    to lr, so a few elements may differ by up to lr a step; a wrong gradient moves most of them."""
    assert set(got) == set(want)
    for k, w in want.items():
        assert got[k].dtype == w.dtype and got[k].shape == w.shape, k
        d = (got[k] - w).abs()
        off = (d > 1e-2 * lr * steps).float().mean().item()
        assert off < 0.02, (k, off)
        assert d.max() <= lr * steps, (k, d.max().item())


# the losses every mode splits exactly over micro-batches, and the whole batch's gradient norm;
# each process trims its micro-batches' padding, so the two sides run other shapes: other
# summation orders in the matmuls and the log-softmax, float32 noise of ~1e-6 relative (~1e-5
# absolute) on each log-prob. Every loss here is a mean of per-token terms that are smooth in the
# log-probs with slopes of order 1 (ratio = exp(logp - old), the KL estimators, the entropy), so
# a loss moves by ~1e-5 absolute: rel 1e-3 (losses of order 1e-1..1e1) and abs 1e-4 (losses near
# zero: pg_loss, whose terms nearly cancel) leave a factor of 10 or more for a slower or faster
# CPU's kernels (measured on this test's cases: at most 1e-5 relative, ppo/grad_norm); a wrong
# gradient, weight or mask moves them by 1e-2 or more.
EXACT = (
    "ppo/pg_loss",
    "ppo/kl_loss",
    "ppo/entropy_loss",
    "ppo/grad_norm",
    "reward/score_mean",
    "ppo/advantages_mean",
    "ppo/returns_mean",
    "ppo/entropy_rollout",
    "ppo/kl_ref",
)
LOSS_TOL = dict(rel=1e-3, abs=1e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_two_process_learner_equals_one_process(tiny_model_dir, tmp_path, case):
    overrides = CASES[case]
    two = _two_processes(tiny_model_dir, tmp_path, overrides)
    one_learner, one = _one_process(tiny_model_dir, overrides, tmp_path)
    for step in ("step_a", "step_b"):
        for key in EXACT:
            assert two[step][key] == pytest.approx(one[step][key], **LOSS_TOL), (step, key)
    if case == "fused-micro":
        assert one_learner.forwards_saved == 1  # step B: the old log-probs came with the forward
    # the full state dict a push sends: every name, gathered from the shards, equal to one process's
    lr, steps = one_learner.cfg.actor_lr, one_learner.scheduler.last_epoch // 2  # optimiser steps per batch
    _close(two["weights_a"], one["weights_a"], lr, steps)
    _close(two["weights_b"], one["weights_b"], lr, steps)  # one step from the same checkpoint
    # the sharded checkpoint taken after step A resumes both processes to where step B is the same
    for k, w in two["weights_b"].items():
        assert torch.equal(two["weights_b_again"][k], w), k
    assert two["step_b_again"]["ppo/pg_loss"] == two["step_b"]["ppo/pg_loss"]
    # the final model the run writes is the gathered policy
    final = load_file(str(tmp_path / "final" / "model.safetensors"))
    for k, v in final.items():
        assert torch.equal(v, two["weights_b_again"][k]), k


def test_a_two_process_checkpoint_resumes_in_one_process(tiny_model_dir, tmp_path):
    overrides = CASES["two-minibatches"]
    two = _two_processes(tiny_model_dir, tmp_path, overrides)
    cfg = learner_config(tiny_model_dir, overrides)
    learner = PolicyTrainer(cfg, total_updates=10)
    before = {k: v.clone() for k, v in learner.policy_state_dict().items()}
    learner.load_state_dict(torch.load(tmp_path / "learner.pt", weights_only=False), tmp_path / "actor")
    for k, w in two["weights_a"].items():  # the shards, put back together
        assert torch.equal(learner.policy_state_dict()[k], w), k
    assert any(not torch.equal(before[k], v) for k, v in two["weights_a"].items())
    assert learner.optimizer.state  # Adam's moments came back too: step B is step B
    _, b = batches(learner.pad_id)
    learner.step(b)
    _close(learner.policy_state_dict(), two["weights_b"], cfg.actor_lr, 2)


def test_a_one_process_checkpoint_loads_into_a_missing_actor_error(tiny_model_dir, tmp_path):
    learner = PolicyTrainer(learner_config(tiny_model_dir), total_updates=10)
    state = learner.state_dict()
    del state["policy"], state["optimizer"]
    with pytest.raises(FileNotFoundError, match="has no actor"):
        learner.load_state_dict(state, tmp_path / "actor")
