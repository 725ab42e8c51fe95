"""The full PPO objective of one micro-batch, as a pure function: the policy loss (clipped,
dual-clipped, GSPO or CISPO), the entropy bonus, the KL loss to the reference, the PTX/SFT loss and
the top-k forward KL to a teacher (on-policy distillation, ppo/distill.py).

    loss = pg_loss - entropy_coef * entropy + kl_loss_coef * kl_loss + ptx_coef * ptx_loss
           + forward_kl_coef * forward_kl

Each term is aggregated by `loss_agg_mode` and weighted by the micro-batch's share of its
mini-batch (`AggNorm.scale`), so summing `loss` over the micro-batches of a mini-batch gives the
one-pass loss of the whole mini-batch (gradient accumulation equal to one pass, in every mode).

Shapes: `B` sequences of the micro-batch, `T` response positions, `V` vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .core import AggNorm, agg_loss, masked_mean
from .distill import topk_forward_kl
from .kl import kl_penalty
from .losses import POLICY_LOSSES

# the aggregation a policy loss uses whatever `loss_agg_mode` says (GSPO: the paper's)
FIXED_AGG_MODES = {"gspo": "seq-mean-token-mean"}


@dataclass(frozen=True)
class ObjectiveSettings:
    """The config's keys the objective reads (see the PPO table in docs/algorithms.md)."""

    policy_loss: str = "vanilla"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip_c: float | None = 3.0  # None: no dual clip
    loss_agg_mode: str = "token-mean"
    entropy_coef: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_penalty: str = "kl"
    ptx_coef: float = 0.0
    forward_kl_coef: float = 0.0  # the top-k forward KL to a teacher (distill.forward_kl_coef)

    @classmethod
    def from_config(cls, cfg) -> "ObjectiveSettings":  # a services.common.config.Config (not imported here)
        # CISPO's lower bound is its own key (default 1: none, as the paper); its upper is pg_clip_high's
        cispo = POLICY_LOSSES.canonical(cfg.policy_loss) == "cispo"
        return cls(
            policy_loss=cfg.policy_loss,
            clip_low=cfg.cispo_clip_low if cispo else cfg.clip_low,
            clip_high=cfg.clip_high,
            dual_clip_c=cfg.dual_clip_c if cfg.dual_clip_loss else None,
            loss_agg_mode=cfg.loss_agg_mode,
            entropy_coef=cfg.entropy_coef,
            use_kl_loss=cfg.use_kl_loss,
            kl_loss_coef=cfg.kl_loss_coef,
            kl_penalty=cfg.kl_penalty,
            ptx_coef=cfg.ptx_coef,
            forward_kl_coef=cfg.distill.forward_kl_coef if cfg.distill.enabled else 0.0,
        )


def ppo_objective(
    s: ObjectiveSettings,
    log_prob: torch.Tensor,
    entropy: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    norm: AggNorm | None = None,
    ref_log_prob: torch.Tensor | None = None,
    kl_input: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    ptx_loss: torch.Tensor | None = None,
    ptx_share: float = 1.0,
    student_top: torch.Tensor | None = None,
    teacher_top: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, tuple[float, float]]]:
    """The loss of one micro-batch, scaled for accumulation, and its metrics.

    log_prob, entropy: (B, T) under the policy being trained (with gradients); old_log_prob,
    advantages, mask, rollout_is_weights: (B, T). ref_log_prob: (B, T), or (B, T, V) with
    kl_penalty 'full', in which case `kl_input` is the policy's (B, T, V) log-probabilities.
    norm: the mini-batch's `AggNorm` (None: this micro-batch is the whole mini-batch).
    ptx_loss: the PTX/SFT loss of this micro-batch's SFT examples, weighted by `ptx_share`
    (its share of the mini-batch's examples). student_top, teacher_top: (B, T, k) the policy's
    log-probs (with gradients) and the teacher's of the teacher's top-k tokens, for the top-k
    forward KL.
    Returns (loss, metrics): each metric is (value, weight), the weight its share of the
    mini-batch, so the sums of value x weight over the micro-batches give the mini-batch's value.
    """
    norm = norm or AggNorm(mask)
    pg_mode = FIXED_AGG_MODES.get(POLICY_LOSSES.canonical(s.policy_loss), s.loss_agg_mode)
    pg_scale, scale = norm.scale(mask, pg_mode), norm.scale(mask, s.loss_agg_mode)
    pg_loss, clipfrac, ppo_kl, clipfrac_lower = POLICY_LOSSES.get(s.policy_loss)(
        old_log_prob,
        log_prob,
        advantages,
        mask,
        cliprange_low=s.clip_low,
        cliprange_high=s.clip_high,
        clip_ratio_c=s.dual_clip_c,
        loss_agg_mode=s.loss_agg_mode,
        rollout_is_weights=rollout_is_weights,
    )
    entropy_loss = agg_loss(entropy, mask, s.loss_agg_mode)
    loss = pg_loss * pg_scale
    if s.entropy_coef:
        loss = loss - s.entropy_coef * entropy_loss * scale
    tokens = float(mask.sum()) / max(norm.tokens, 1.0)  # token-averaged metrics weigh by tokens
    metrics = {
        "ppo/pg_loss": (pg_loss.item(), pg_scale),
        "ppo/pg_clipfrac": (clipfrac.item(), tokens),
        "ppo/pg_clipfrac_lower": (clipfrac_lower.item(), tokens),
        "ppo/approx_kl": (ppo_kl.item(), tokens),
        "ppo/entropy_loss": (entropy_loss.item(), scale),  # as the loss aggregates it
        "ppo/entropy": (masked_mean(entropy.detach(), mask).item(), tokens),
    }  # per token
    if s.use_kl_loss and ref_log_prob is not None:
        kl_loss = agg_loss(
            kl_penalty(log_prob if kl_input is None else kl_input, ref_log_prob, s.kl_penalty), mask, s.loss_agg_mode
        )
        loss = loss + s.kl_loss_coef * kl_loss * scale
        metrics["ppo/kl_loss"] = (kl_loss.item(), scale)
    if ptx_loss is not None:
        loss = loss + s.ptx_coef * ptx_loss * ptx_share
        metrics["ppo/ptx_loss"] = (ptx_loss.item(), ptx_share)
    if s.forward_kl_coef and student_top is not None and teacher_top is not None:
        forward_kl = agg_loss(topk_forward_kl(student_top, teacher_top), mask, s.loss_agg_mode)
        loss = loss + s.forward_kl_coef * forward_kl * scale
        metrics["distill/forward_kl_topk"] = (forward_kl.item(), scale)
    return loss, metrics
