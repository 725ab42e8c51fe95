"""Loss terms of the PPO objective: clipped / dual-clipped policy loss (and its variants GSPO and
CISPO), clipped value loss, entropy bonus and the PTX/SFT next-token loss.

Shapes: `B` sequences, `T` response positions, `V` vocabulary. `response_mask` (B, T) is 1 on
tokens the policy sampled and 0 on padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .core import agg_loss, masked_mean
from .registry import Registry


def clip_bounds(cliprange: float | None, low: float | None, high: float | None, loss: str) -> tuple[float, float]:
    """The clip range's two sides: `low` and `high`, each `cliprange` when not given; `loss` names
    the loss in the error when a side is still missing."""
    low = cliprange if low is None else low
    high = cliprange if high is None else high
    if low is None or high is None:
        raise ValueError(f"{loss} needs cliprange or both cliprange_low and cliprange_high")
    return low, high


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
):
    """PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347) with the dual clip of
    Ye et al. 2020 (arXiv:1912.09729) for negative advantages.

    old_log_prob, log_prob, advantages, response_mask: (B, T).
    ratio = exp(clamp(log_prob - old_log_prob, -10, 10))
    L1 = -A * ratio;  L2 = -A * clip(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clipped = max(L1, L2);  where A < 0: min(clipped, -A * clip_ratio_c)   (the dual clip)
    `cliprange_low`/`cliprange_high` default to `cliprange` (asymmetric "clip-higher" when they
    differ). `clip_ratio_c=None` gives the plain clipped objective.
    rollout_is_weights: optional (B, T) truncated importance weights pi_old / mu between the
    learner and the sampler (`rollout_importance_weights`); each token's loss is multiplied by
    its weight before aggregation, as verl's `rollout_is`. None leaves the loss unchanged.
    Returns pg_loss (scalar, aggregated by `loss_agg_mode`), pg_clipfrac (share of tokens where
    the clip is active), ppo_kl (mean of old - new log-prob, an estimate of KL(old || new)) and
    pg_clipfrac_lower (share of tokens where the dual clip is active).
    """
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be greater than 1.0 for dual-clip PPO, got {clip_ratio_c}")
    cliprange_low, cliprange_high = clip_bounds(cliprange, cliprange_low, cliprange_high, "compute_policy_loss")
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-10.0, max=10.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)

    if clip_ratio_c is None:
        pg_losses = clip_pg_losses1
        pg_clipfrac_lower = torch.zeros((), dtype=pg_clipfrac.dtype, device=pg_clipfrac.device)
    else:
        pg_losses3 = -advantages * clip_ratio_c
        clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
        pg_clipfrac_lower = masked_mean(
            (torch.gt(clip_pg_losses1, pg_losses3) & (advantages < 0)).float(), response_mask
        )
        pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


POLICY_LOSSES = Registry("policy_loss")
POLICY_LOSSES.register("vanilla")(compute_policy_loss)


def gspo_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """GSPO-token's ratio s_i,t over the last dimension (a sequence's tokens): the value of the
    sequence's geometric-mean ratio over its `response_mask` tokens, the gradient of each token's
    own log-prob. Any leading shape; its log capped at 10."""
    mask = response_mask.to(log_prob.dtype)
    # selected, not multiplied: a NaN or -inf at padding would survive `* 0`
    log_ratio = torch.where(response_mask.bool(), log_prob - old_log_prob, 0.0)
    seq_log_ratio = log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    return torch.exp(torch.clamp(token_log_ratio, max=10.0))


@POLICY_LOSSES.register("gspo")
def compute_gspo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "seq-mean-token-mean",
    rollout_is_weights: torch.Tensor | None = None,
):
    """GSPO, sequence-level importance ratio (Zheng et al. 2025, arXiv:2507.18071, eq. 7 and its
    token-level form GSPO-token).

    s_i = exp(mean_t (log_prob - old_log_prob) over sequence i's valid tokens)
    s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]   (the value of s_i, the gradient of each token)
    L = max(-A * s_i,t, -A * clip(s_i,t, 1 - cliprange_low, 1 + cliprange_high)),
    aggregated seq-mean-token-mean as in the paper (`loss_agg_mode` and `clip_ratio_c` are
    accepted for a uniform signature and not used: the dual clip is a token-ratio device).
    `rollout_is_weights` (B, T), when given, multiplies each token's loss before aggregation, as
    in `compute_policy_loss`.
    Shapes as `compute_policy_loss`; returns the same four values (pg_clipfrac_lower = 0).
    """
    cliprange_low, cliprange_high = clip_bounds(cliprange, cliprange_low, cliprange_high, "compute_gspo_policy_loss")
    log_ratio = log_prob - old_log_prob
    ratio = gspo_ratio(log_prob, old_log_prob, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, "seq-mean-token-mean")
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    ppo_kl = masked_mean(-log_ratio.detach(), response_mask)
    return pg_loss, pg_clipfrac, ppo_kl, torch.zeros((), dtype=pg_loss.dtype, device=pg_loss.device)


@POLICY_LOSSES.register("cispo")
def compute_cispo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
):
    """CISPO, clipped IS-weight policy optimisation (MiniMax-M1, arXiv:2506.13585, eq. 4-5): a
    REINFORCE loss whose tokens are weighted by the clipped, detached importance ratio.

    ratio = exp(clamp(log_prob - old_log_prob, -10, 10))
    w = sg[clip(ratio, 1 - cliprange_low, 1 + cliprange_high)]
    L = -A * w * log_prob   per token, aggregated by `loss_agg_mode`.
    The gradient flows through log_prob only: d L / d log_prob = -A * w (times the aggregation's
    share of the token), so no token's gradient is dropped as PPO's clip drops it; the clip only
    bounds the weight. `cliprange_low` = 1 puts no lower bound on the weight (as the paper does);
    `cliprange_low`/`cliprange_high` default to `cliprange`. `clip_ratio_c` is accepted for a
    uniform signature and not used (the dual clip is PPO's). `rollout_is_weights` (B, T), when
    given, multiplies each token's loss before aggregation, as in `compute_policy_loss`.
    Shapes as `compute_policy_loss`; returns (pg_loss, pg_clipfrac: share of tokens whose ratio
    lies outside the bounds, ppo_kl: mean of old - new log-prob, pg_clipfrac_lower: share of tokens
    below the lower bound).
    """
    cliprange_low, cliprange_high = clip_bounds(cliprange, cliprange_low, cliprange_high, "compute_cispo_policy_loss")
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-10.0, max=10.0)
    ratio = torch.exp(log_ratio.detach())
    weight = torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    pg_losses = -advantages * weight * log_prob
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    lower = ratio < 1 - cliprange_low
    pg_clipfrac = masked_mean((lower | (ratio > 1 + cliprange_high)).float(), response_mask)
    pg_clipfrac_lower = masked_mean(lower.float(), response_mask)
    ppo_kl = masked_mean(-log_ratio.detach(), response_mask)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float | None,
    loss_agg_mode: str = "token-mean",
):
    """Value regression, 1/2 (V - R)^2, clipped as PPO2 does (OpenAI baselines).

    vpreds: (B, T) values of the critic being trained; values: (B, T) the critic's values when
    the batch was collected; returns: (B, T) targets. With `cliprange_value` set,
    V_clip = values + clip(vpreds - values, -c, c) and the loss is max((V-R)^2, (V_clip-R)^2)/2.
    Returns vf_loss (scalar) and vf_clipfrac (share of tokens where the clipped term is larger).
    """
    losses = (vpreds - returns) ** 2
    if cliprange_value is None:
        return 0.5 * agg_loss(losses, response_mask, loss_agg_mode), torch.zeros(
            (), dtype=vpreds.dtype, device=vpreds.device
        )
    vpredclipped = values + torch.clamp(vpreds - values, -cliprange_value, cliprange_value)
    losses_clipped = (vpredclipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(torch.maximum(losses, losses_clipped), response_mask, loss_agg_mode)
    vf_clipfrac = masked_mean(torch.gt(losses_clipped, losses).float(), response_mask)
    return vf_loss, vf_clipfrac


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution of each position. logits: (..., V) -> (...)."""
    log_probs = F.log_softmax(logits.float(), dim=-1)
    return -(log_probs.exp() * log_probs).sum(dim=-1)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of each label. logits: (B, T, V); labels: (B, T) -> (B, T)."""
    log_probs = F.log_softmax(logits.float(), dim=-1)
    return log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def compute_sft_loss(log_prob: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str = "token-mean"):
    """PTX / SFT next-token loss (InstructGPT's PPO-ptx, arXiv:2203.02155): -log p(target).

    log_prob: (B, T) log-probabilities of the target tokens; loss_mask: (B, T) 1 on targets.
    """
    return agg_loss(-log_prob, loss_mask, loss_agg_mode)
