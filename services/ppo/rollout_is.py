"""Truncated importance sampling (TIS) between the sampler and the learner.

The sampler (a bf16 vLLM engine, or a policy a few versions behind when `max_staleness` >= 1)
draws the response tokens from a distribution `mu` that differs slightly from the learner's
`pi_old`. PPO's ratio pi / pi_old corrects for the policy moving during the update, not for
this gap; the token-level importance weight pi_old / mu does, truncated from above so that a
few tokens the sampler found unlikely cannot dominate the gradient (Yao et al. 2025, "Your
Efficient RL Framework Secretly Brings You Off-Policy RL Training",
https://fengyao.notion.site/off-policy-rl; the truncated IS of IMPALA's V-trace, Espeholt et al.
2018, arXiv:1802.01561). As verl's `rollout_is` (token level, truncate mode) and OpenRLHF's
`--enable_vllm_is_correction`. The config's `rollout_correction` chooses between this
(`token_tis`) and the other modes of `rollout_correction.py`.

Shapes: `B` sequences, `T` response positions; `response_mask` (B, T) is 1 on sampled tokens
and 0 on padding.
"""

from __future__ import annotations

import torch

from .core import masked_mean

LOG_RATIO_CLAMP = 20.0


def rollout_importance_weights(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor, threshold: float
):
    """Token-level truncated importance weights pi_old / mu, capped at `threshold`.

    old_log_prob: (B, T) the learner's log-probs of the sampled tokens (pi_old);
    rollout_log_prob: (B, T) the sampler's log-probs of the same tokens (mu);
    response_mask: (B, T); threshold: the cap C > 0.
    ratio = exp(clamp(old_log_prob - rollout_log_prob, -20, 20))
    weights = min(ratio, C) on valid tokens, 0 on padding; detached (no gradient flows through
    the correction), float32. The policy loss multiplies its per-token terms by `weights`.
    Returns (weights (B, T), metrics) with float metrics over the valid tokens only:
    ppo/is_ratio_mean (mean untruncated ratio), ppo/is_ratio_max, ppo/is_clipped_frac (share of
    tokens whose ratio exceeds C) and ppo/is_weight_mean (mean truncated weight). With no valid
    token every metric is 0.
    """
    if not threshold > 0:
        raise ValueError(f"rollout_importance_weights needs a threshold > 0, got {threshold}")
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.shape != response_mask.shape:
        raise ValueError(
            f"shapes differ: old_log_prob {tuple(old_log_prob.shape)}, rollout_log_prob "
            f"{tuple(rollout_log_prob.shape)}, response_mask {tuple(response_mask.shape)}"
        )
    with torch.no_grad():
        valid = response_mask.bool()
        log_ratio = old_log_prob.detach().float() - rollout_log_prob.detach().float().to(old_log_prob.device)
        ratio = torch.exp(torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        ratio = torch.where(valid, ratio, torch.zeros_like(ratio))  # padding may hold anything, NaN included
        weights = torch.clamp(ratio, max=threshold)
        clipped = (ratio > threshold).float()
        n_valid = int(valid.sum())
        metrics = {
            "ppo/is_ratio_mean": masked_mean(ratio, valid).item(),
            "ppo/is_ratio_max": ratio[valid].max().item() if n_valid else 0.0,
            "ppo/is_clipped_frac": masked_mean(clipped, valid).item(),
            "ppo/is_weight_mean": masked_mean(weights, valid).item(),
        }
    return weights.detach(), metrics


def staleness_weights(
    token_versions: torch.Tensor, policy_version: int, max_staleness: int, response_mask: torch.Tensor
):
    """The staleness bound, token by token: 1 on a token sampled by a policy at most
    `max_staleness` versions behind `policy_version`, 0 on an older one (its loss term is dropped;
    it stays in the context of the tokens after it). A response whose decoding crossed a weight
    update (`generation.weight_update: in_flight`, a resumed partial rollout) has tokens of
    several versions: each is judged by its own, not by the response's first.

    token_versions: (B, T) int, the version that sampled each token (anything on padding);
    response_mask: (B, T). Returns (weights (B, T) float32, 0 on padding; metrics): rollout/stale_token_frac (share
    of valid tokens beyond the bound), rollout/staleness_max and rollout/staleness_token_mean
    (versions behind, over the valid tokens)."""
    with torch.no_grad():
        valid = response_mask.bool()
        behind = (policy_version - token_versions.to(response_mask.device)).float()
        stale = (behind > max_staleness) & valid
        n_valid = int(valid.sum())
        metrics = {
            "rollout/stale_token_frac": masked_mean(stale.float(), valid).item(),
            "rollout/staleness_max": behind[valid].max().item() if n_valid else 0.0,
            "rollout/staleness_token_mean": masked_mean(behind, valid).item(),
        }
    return (valid & ~stale).float(), metrics
