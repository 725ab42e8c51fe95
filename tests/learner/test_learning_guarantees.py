"""Learning, asserted only where the arithmetic guarantees it, so that it holds on any CPU.

A whole training run is a chaotic trajectory: another CPU's float kernels (another
`ATEN_CPU_CAPABILITY`, another thread count) sample other tokens from the first iteration on and
end somewhere else. What does not depend on the trajectory is what one update does to the batch
it was computed from:

- the policy update moves probability towards the responses with positive advantage: on the
  fixed batch, the advantage-weighted change of the log-probs is positive (a gradient step on the
  surrogate, to first order `lr * g^T P g > 0` for Adam's diagonal preconditioner P), and the
  importance-weighted estimate of the batch's reward under the new policy exceeds its reward under
  the old one, for every advantage estimator;
- the critic is a regression: trained on a fixed batch of returns it must fit them, its explained
  variance going from 0 (a zero-initialised head predicts a constant) to most of the variance.

`make flake-hunt MODE=machines` runs this file under ATEN_CPU_CAPABILITY default / avx2 / avx512
and 1 / 2 / 3 threads (docs/measurements.md, "Learning assertions on any CPU", has the margins)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.config import load_config
from services.common.modeling import response_log_probs
from services.common.types import Rollout, SamplingParams
from services.critic.critic import Critic
from services.generation.policy import make_backend
from services.learner.trainer import PolicyTrainer
from services.ppo import explained_variance
from services.ppo.core import masked_sum
from services.reward.scorer import build_scorer
from services.training.data import config_prompts
from services.training.sampling import sample_groups

ROOT = Path(__file__).resolve().parents[2]
BATCH = 32


def _cfg(model_dir: str, *overrides: str):
    return load_config(
        ROOT / "configs" / "tiny-cpu.yaml",
        [f"model.path={model_dir}", f"rollout_batch_size={BATCH}", "ppo_mini_batch_size=16", *overrides],
    )


def _rollout(cfg, critic: Critic | None) -> tuple[Rollout, list[float]]:
    """One batch sampled by the tiny policy and scored by the task's rules (as a worker does)."""
    torch.manual_seed(cfg.run.seed)
    backend = make_backend(cfg)
    records = config_prompts(cfg, "train", backend.tokenizer)[: cfg.rollout_batch_size]
    groups, _, _ = sample_groups(
        records,
        [f"0:{r.id}" for r in records],
        backend,
        build_scorer(cfg.reward, device="cpu"),
        backend.tokenizer,
        SamplingParams.for_training(cfg),
        critic,
        cfg.prompt_length,
    )
    rewards = [s.reward for g in groups for s in g.scores]
    return Rollout.from_groups(groups), rewards


def _token_log_probs(learner: PolicyTrainer, batch) -> torch.Tensor:
    """log pi(response token | what came before) under the learner's policy now: (B, T)."""
    with torch.no_grad():
        return response_log_probs(learner.policy, batch, learner.temperature)["log_probs"]


@pytest.mark.parametrize(
    "overrides",
    [
        ["adv_estimator=gae"],
        ["adv_estimator=grpo", "num_return_sequences_in_group=4"],
        ["adv_estimator=reinforce"],
    ],
    ids=["gae", "grpo", "reinforce"],
)
def test_one_update_moves_the_policy_towards_the_rewarded_responses(tiny_model_dir, overrides):
    cfg = _cfg(tiny_model_dir, *overrides)
    critic = Critic.from_config(cfg) if cfg.needs_critic else None
    rollout, rewards = _rollout(cfg, critic)
    learner = PolicyTrainer(cfg, total_updates=1)
    exp = learner.make_experience(rollout)
    mask = exp.batch.response_mask
    assert exp.old_log_probs is not None  # the tiny preset's 2 epochs keep them apart from the update
    before = _token_log_probs(learner, exp.batch)
    learner.update(exp, critic)
    after = _token_log_probs(learner, exp.batch)

    # the surrogate's direction: the mean over tokens of A_t * (log pi_new - log pi_old)
    moved = float(masked_sum(exp.advantages * (after - exp.old_log_probs), mask)) / float(mask.sum())
    # the batch's reward under the new policy, importance-weighted from the samples of the old one
    r = torch.tensor(rewards, dtype=torch.float64)
    w = torch.exp(masked_sum(after - before, mask, dim=1).double())  # pi_new(y) / pi_old(y)
    reweighted = float((w * r).sum() / w.sum())
    print(
        f"{cfg.adv_estimator}: advantage-weighted log-prob change {moved:+.4f} a token; "
        f"batch reward {r.mean():.4f} -> {reweighted:.4f} (importance-weighted), "
        f"weights {float(w.min()):.3f}..{float(w.max()):.3f}"
    )
    assert r.std() > 0, "the batch's rewards must differ for an update to prefer some responses"
    assert moved > 0.02, moved
    assert reweighted > float(r.mean()) + 0.02, (reweighted, float(r.mean()))


def test_the_critic_fits_a_fixed_batch_of_returns(tiny_model_dir):
    """The critic's regression: the returns of one batch (GAE, gamma 1, lambda 0.95, from the rule
    reward), fitted by full-batch steps of the critic's own train_step. A zero-initialised value
    head explains nothing (explained variance 0); after the steps it explains most of the variance."""
    cfg = _cfg(tiny_model_dir, "adv_estimator=gae", "critic.lr=1e-3")
    critic = Critic.from_config(cfg)
    rollout, _ = _rollout(cfg, critic)
    learner = PolicyTrainer(cfg, total_updates=1)
    exp = learner.make_experience(rollout)
    batch, returns, mask = exp.batch, exp.returns, exp.batch.response_mask
    assert exp.values is not None
    ev = [explained_variance(critic.values(batch), returns, mask)]
    for _ in range(4):
        for _ in range(10):
            critic.train_step(batch, returns, critic.values(batch))
        ev.append(explained_variance(critic.values(batch), returns, mask))
    print("explained variance every 10 steps:", " ".join(f"{v:.3f}" for v in ev))
    assert ev[0] == pytest.approx(0.0, abs=1e-6)
    assert ev[-1] > 0.5, ev
