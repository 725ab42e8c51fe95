"""Masked reductions and loss aggregation shared by every PPO formula.

Shapes: `B` sequences, `T` response positions. A mask is 1.0 on response tokens that count
(sampled by the policy, before and including EOS) and 0.0 on padding; masked positions never
change a result.
"""

from __future__ import annotations

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is 1. `values`, `mask`: same shape. Masked NaNs are ignored."""
    return (
        torch.where(mask.bool(), values, torch.zeros_like(values)).sum()
        if dim is None
        else torch.where(mask.bool(), values, torch.zeros_like(values)).sum(dim=dim)
    )


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` over positions where `mask` is 1 (0 when the mask is empty)."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `values` over the masked positions (Bessel-corrected when `unbiased`)."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n > 1:
            var = var * n / (n - 1)
    return var


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over the masked positions: 1 when the critic
    predicts every return, 0 when it predicts no better than their mean, negative when worse; nan
    when the returns do not vary."""
    var = masked_var(returns, mask)
    if var.item() <= 1e-12:
        return float("nan")
    return (1 - masked_var(returns - values, mask) / var).item()


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalise `values` to zero mean and unit variance over the masked positions.

    values, mask: (B, T). Masked-out positions are returned as 0. With `shift_mean=False` the
    mean is added back (only the scale changes), as in TRL/verl.
    """
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """Reduce a per-token loss to a scalar.

    loss_mat, loss_mask: (B, T).
    - token-mean: mean over every unmasked token of the batch.
    - seq-mean-token-sum: mean over sequences of each sequence's token sum.
    - seq-mean-token-mean: mean over sequences of each sequence's token mean.
    - seq-mean-token-sum-norm: sum over the batch of each sequence's token sum, divided by the
      padded response length T, a constant normaliser (Dr. GRPO, arXiv:2503.20783).
    Sequences whose mask is empty do not count in the sequence means.
    """
    if loss_agg_mode == "token-mean":
        return masked_mean(loss_mat, loss_mask)
    seq_sum = masked_sum(loss_mat, loss_mask, dim=-1)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return seq_sum.sum() / loss_mask.shape[-1]
    tokens = loss_mask.sum(dim=-1)
    valid = (tokens > 0).float()
    if loss_agg_mode == "seq-mean-token-sum":
        per_seq = seq_sum
    elif loss_agg_mode == "seq-mean-token-mean":
        per_seq = seq_sum / tokens.clamp(min=1)
    else:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")
    return (per_seq * valid).sum() / valid.sum().clamp(min=1)


def clip_by_value(x: torch.Tensor, limit: float | None) -> torch.Tensor:
    """Clamp to [-limit, limit]; `None` leaves `x` unchanged (advantage_clip, reward_clip)."""
    return x if limit is None else x.clamp(-limit, limit)


class AggNorm:
    """What `agg_loss` divides by over a whole mini-batch: its unmasked tokens, its sequences with
    at least one token, and its padded response width. mask: (B, T)."""

    def __init__(self, mask: torch.Tensor):
        self.tokens = float(mask.sum())
        self.sequences = float((mask.sum(-1) > 0).sum())
        self.width = mask.shape[-1]

    def scale(self, mask: torch.Tensor, loss_agg_mode: str) -> float:
        """The weight of a micro-batch's `agg_loss` (its rows' `mask`, any width up to the
        mini-batch's) such that the weighted sum over the micro-batches is `agg_loss` over the
        whole mini-batch, in every mode: gradient accumulation that equals one pass."""
        if loss_agg_mode == "token-mean":
            return float(mask.sum()) / max(self.tokens, 1.0)
        if loss_agg_mode == "seq-mean-token-sum-norm":
            return mask.shape[-1] / self.width
        if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
            return float((mask.sum(-1) > 0).sum()) / max(self.sequences, 1.0)
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")
