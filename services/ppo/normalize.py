"""Reward post-processing before advantages: normalisation (`reward_norm`: batch | group |
running, with `reward_shift` / `reward_scale`) and clipping (`reward_clip`).

`scores` is (B,), one outcome reward per sequence; `index` (B,) groups the samples of a prompt.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .advantages import group_stats
from .core import clip_by_value

REWARD_NORMS = ("batch", "group", "running")


class RunningMeanStd:
    """Running mean and variance over every score seen (Chan et al. parallel update).
    Its state is plain floats, so it goes into a checkpoint as JSON."""

    def __init__(self) -> None:
        self.mean, self.var, self.count = 0.0, 1.0, 0

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().double().flatten()
        n = x.numel()
        if n == 0:
            return
        batch_mean, batch_var = x.mean().item(), x.var(unbiased=False).item()
        total = self.count + n
        delta = batch_mean - self.mean
        m2 = self.var * self.count + batch_var * n + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.var = m2 / total
        self.count = total

    @property
    def std(self) -> float:
        return self.var**0.5

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count = float(state["mean"]), float(state["var"]), int(state["count"])


def normalize_rewards(
    scores: torch.Tensor,
    reward_norm: str | None,
    reward_shift: bool = False,
    reward_scale: bool = False,
    index: Sequence | None = None,
    running: RunningMeanStd | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Normalise outcome rewards (ROLL's reward_norm/reward_shift/reward_scale).

    Statistics come from the whole batch (`batch`), the sample's group (`group`, needs `index`)
    or running statistics updated with this batch first (`running`, needs `running`).
    `reward_shift` only subtracts the mean, `reward_scale` only divides by the std; neither (or
    both) does both. `reward_norm=None` returns the scores unchanged. scores: (B,) -> (B,).
    """
    if reward_norm is None:
        return scores
    if reward_norm == "batch":
        mean = scores.mean()
        std = scores.std() if scores.numel() > 1 else torch.ones((), dtype=scores.dtype)
    elif reward_norm == "group":
        if index is None:
            raise ValueError("reward_norm 'group' needs a group index per sample")
        mean, std, _ = group_stats(scores, index)
    elif reward_norm == "running":
        if running is None:
            raise ValueError("reward_norm 'running' needs a RunningMeanStd")
        running.update(scores)
        mean = torch.tensor(running.mean, dtype=scores.dtype)
        std = torch.tensor(running.std, dtype=scores.dtype)
    else:
        raise ValueError(f"unknown reward_norm {reward_norm!r}; valid: {', '.join(REWARD_NORMS)} or null")
    if reward_shift and not reward_scale:
        return scores - mean
    if reward_scale and not reward_shift:
        return scores / (std + eps)
    return (scores - mean) / (std + eps)


def postprocess_rewards(
    scores: torch.Tensor,
    reward_norm: str | None,
    reward_shift: bool,
    reward_scale: bool,
    reward_clip: float | None,
    index: Sequence | None = None,
    running: RunningMeanStd | None = None,
) -> torch.Tensor:
    """Normalise, then clip to [-reward_clip, reward_clip]. scores: (B,) -> (B,)."""
    out = normalize_rewards(scores, reward_norm, reward_shift, reward_scale, index, running)
    return clip_by_value(out, reward_clip)
