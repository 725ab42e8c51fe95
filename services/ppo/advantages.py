"""Advantage estimators: GAE (with a critic) and the critic-free GRPO, RLOO, REINFORCE, REINFORCE++.

Every estimator takes `token_level_rewards` (B, T) and `response_mask` (B, T) and returns
`(advantages, returns)`, both (B, T), zero where the mask is 0. Outputs are raw: whitening and
clipping are separate steps (`masked_whiten`, `clip_by_value`) chosen by the config.
`index` (B,) holds a group id per sequence: samples of one prompt share an id.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import torch

from .core import masked_whiten
from .registry import Registry


def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float, lam: float
):
    """Generalised Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438).

    delta_t = r_t + gamma * V(s_{t+1}) - V(s_t);  A_t = delta_t + gamma * lam * A_{t+1}
    token_level_rewards, values, response_mask: (B, T). values[t] is V of the state before
    response token t. The value after the last valid token is 0 (the episode ends). A masked
    position is skipped: the recursion carries its next value and advantage across it, so
    rewards and values under a 0 mask change no output.
    Returns advantages (B, T) and returns = advantages + values (B, T), both 0 where masked.
    """
    mask = response_mask.to(values.dtype)
    rewards = torch.where(mask.bool(), token_level_rewards, torch.zeros_like(token_level_rewards))
    vals = torch.where(mask.bool(), values, torch.zeros_like(values))
    B, T = values.shape
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)
    last_gae = torch.zeros_like(next_value)
    advantages = torch.zeros_like(vals)
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        gae = delta + gamma * lam * last_gae
        advantages[:, t] = gae * m
        next_value = vals[:, t] * m + next_value * (1 - m)
        last_gae = gae * m + last_gae * (1 - m)
    returns = (advantages + vals) * mask
    return advantages, returns


def group_stats(scores: torch.Tensor, index: Sequence) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample mean, std (unbiased) and size of the sample's group. scores: (B,)."""
    groups: dict = defaultdict(list)
    for i, g in enumerate(index):
        groups[_key(g)].append(i)
    mean = torch.zeros_like(scores)
    std = torch.ones_like(scores)
    size = torch.ones_like(scores)
    for members in groups.values():
        idx = torch.tensor(members, device=scores.device)
        s = scores[idx]
        mean[idx] = s.mean() if len(members) > 1 else torch.zeros((), dtype=scores.dtype)
        std[idx] = s.std() if len(members) > 1 else torch.ones((), dtype=scores.dtype)
        size[idx] = float(len(members))
    return mean, std, size


def _key(g):
    return g.item() if isinstance(g, torch.Tensor) else g


def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence,
    epsilon: float = 1e-6,
    norm_adv_by_std: bool = True,
):
    """GRPO outcome advantage (Shao et al. 2024, arXiv:2402.03300, section 4.1.2).

    score_i = sum_t r_{i,t};  A_i = (score_i - mean_group) / (std_group + epsilon), the same for
    every token of sequence i. `norm_adv_by_std=False` keeps only the mean baseline (Dr. GRPO).
    A group of one has mean 0 and std 1. Returns (advantages, returns), equal, (B, T).
    """
    scores = (token_level_rewards * response_mask).sum(dim=-1)
    mean, std, _ = group_stats(scores, index)
    adv = scores - mean
    if norm_adv_by_std:
        adv = adv / (std + epsilon)
    advantages = adv.unsqueeze(-1) * response_mask
    return advantages, advantages


def compute_rloo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence):
    """RLOO: REINFORCE with a leave-one-out baseline (Ahmadian et al. 2024, arXiv:2402.14740).

    A_i = score_i - mean_{j != i} score_j = n/(n-1) * (score_i - mean_group). A group of one gets
    no baseline. Returns (advantages, returns), equal, (B, T).
    """
    scores = (token_level_rewards * response_mask).sum(dim=-1)
    mean, _, size = group_stats(scores, index)
    factor = torch.where(size > 1, size / (size - 1).clamp(min=1), torch.ones_like(size))
    adv = (scores - mean) * factor
    advantages = adv.unsqueeze(-1) * response_mask
    return advantages, advantages


def compute_reinforce_return(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float):
    """REINFORCE returns-to-go (Williams 1992): G_t = sum_{k>=t} gamma^(k-t) r_k over valid tokens.

    Masked positions are skipped. Returns (advantages, returns), equal, (B, T); whitening the
    advantages (`whiten_advantages`) supplies the batch baseline.
    """
    mask = response_mask.to(token_level_rewards.dtype)
    rewards = torch.where(mask.bool(), token_level_rewards, torch.zeros_like(token_level_rewards))
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    returns = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        g = rewards[:, t] + gamma * running
        returns[:, t] = g * m
        running = g * m + running * (1 - m)
    return returns, returns


def compute_reinforce_plus_plus_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float):
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): token returns-to-go (KL already folded into the
    token rewards) whitened over the whole batch. Returns (advantages, returns), (B, T)."""
    _, returns = compute_reinforce_return(token_level_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask), returns


ADV_ESTIMATORS = Registry("adv_estimator")


@ADV_ESTIMATORS.register("gae")
def _gae(token_level_rewards, response_mask, values=None, index=None, gamma=1.0, lam=0.95):
    if values is None:
        raise ValueError("adv_estimator 'gae' needs values from a critic")
    return compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam)


@ADV_ESTIMATORS.register("reinforce")
def _reinforce(token_level_rewards, response_mask, values=None, index=None, gamma=1.0, lam=0.95):
    return compute_reinforce_return(token_level_rewards, response_mask, gamma)


@ADV_ESTIMATORS.register("grpo")
def _grpo(token_level_rewards, response_mask, values=None, index=None, gamma=1.0, lam=0.95):
    if index is None:
        raise ValueError("adv_estimator 'grpo' needs a group index per sample")
    return compute_grpo_outcome_advantage(token_level_rewards, response_mask, index)


@ADV_ESTIMATORS.register("rloo")
def _rloo(token_level_rewards, response_mask, values=None, index=None, gamma=1.0, lam=0.95):
    if index is None:
        raise ValueError("adv_estimator 'rloo' needs a group index per sample")
    return compute_rloo_outcome_advantage(token_level_rewards, response_mask, index)


@ADV_ESTIMATORS.register("reinforce_plus_plus")
def _reinforce_plus_plus(token_level_rewards, response_mask, values=None, index=None, gamma=1.0, lam=0.95):
    return compute_reinforce_plus_plus_advantage(token_level_rewards, response_mask, gamma)


def compute_advantages(
    adv_estimator: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor | None = None,
    index: Sequence | None = None,
    gamma: float = 1.0,
    lam: float = 0.95,
):
    """The estimator registered as `adv_estimator` in `ADV_ESTIMATORS`. values: (B, T) for GAE;
    index: a group id per sequence for GRPO/RLOO. Returns (advantages, returns), (B, T)."""
    return ADV_ESTIMATORS.get(adv_estimator)(
        token_level_rewards, response_mask, values=values, index=index, gamma=gamma, lam=lam
    )
