"""Making experience: from a batch of scored rollouts to what the update trains on.

    rollout -> old log-probs (the policy before the update), reference log-probs, token-level
               rewards (with the KL penalty when it is in the reward), advantages and returns
               (with on-policy distillation, the teacher's per-token reverse KL added: `distilled`)

The forwards here run without gradients, in micro-batches (`log_prob_micro_batch_size` rows,
padding columns trimmed), so their memory does not grow with the rollout batch.
"""

from __future__ import annotations

import random
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..common.modeling import response_log_probs
from ..common.padding import pad_right
from ..common.sharding.group import Ranks
from ..common.token_batch import TokenBatch, build_token_batch, widen
from ..common.types import Progress, Rollout
from ..ppo import (
    apply_kl_penalty,
    clip_by_value,
    compute_advantages,
    distillation_advantages,
    explained_variance,
    kl_penalty,
    masked_mean,
    masked_var,
    masked_whiten,
    postprocess_rewards,
    reference_log_probs,
    rollout_correction,
    staleness_weights,
)

if TYPE_CHECKING:
    from ..common.config import Config
    from ..ppo import RunningMeanStd
    from ..ppo.objective import ObjectiveSettings


class Actor(Protocol):
    """What the PPO step (`make_experience`, `update.run_update`) reads of the trainer that runs it
    (`PolicyTrainer`, sharded or not); the step changes only the policy's weights, the optimiser,
    the scheduler and the rng."""

    cfg: Config
    policy: Any  # a transformers model (PEFT's around it with LoRA; FSDP-sharded with model.nproc > 1)
    pad_id: int
    device: torch.device
    temperature: float
    ranks: Ranks  # the processes a step's rows are split across
    log_prob_micro: int  # rows per no-grad forward
    on_progress: Progress  # called at each micro-batch forward and optimiser step
    needs_ref: bool
    kl_ctl: Any  # a KL controller (`ppo.kl`): its `value` is the KL coefficient
    reward_stats: RunningMeanStd
    policy_version: int
    objective: ObjectiveSettings
    optimizer: torch.optim.Optimizer
    scheduler: Any  # a transformers LR scheduler
    rng: random.Random
    ptx_examples: list

    def autocast(self) -> AbstractContextManager: ...

    def ref_forward(self, batch: TokenBatch, full: bool) -> dict[str, torch.Tensor]: ...

    def fuses_old_log_probs(self, batch_size: int) -> bool: ...


@dataclass
class Experience:
    batch: TokenBatch
    old_log_probs: torch.Tensor | None  # (B, T); None: taken from the training forward (`fuses_old_log_probs`)
    ref_log_probs: torch.Tensor | None  # (B, T), or (B, T, V) for kl_penalty 'full'
    advantages: torch.Tensor  # (B, T)
    returns: torch.Tensor  # (B, T)
    values: torch.Tensor | None  # (B, T)
    metrics: dict
    # (B, T) the rollout correction's weights (rollout_correction), times 0 on tokens beyond the staleness bound
    rollout_is_weights: torch.Tensor | None = None
    # the sequence KL to the reference and the sequences it is over, for the KL controller (None:
    # the update measures it on its own forward, with fused old log-probs)
    kl_measured: tuple[float, int] | None = None
    # (B, T, k) the teacher's top-k tokens and their log-probs (distill.forward_kl_coef), else None
    teacher_top_ids: torch.Tensor | None = None
    teacher_top_log_probs: torch.Tensor | None = None


def forward_in_micro_batches(learner: Actor, forward, batch: TokenBatch) -> dict[str, torch.Tensor]:
    """`forward(micro_batch)` without gradients over `batch`, in micro-batches of
    `log_prob_micro_batch_size` rows with their padding columns trimmed; each (b, t, ...) output
    widened back and joined into (B, T, ...). With N processes each runs its share of the rows
    and every process gets the whole result (the trainer's `ranks`)."""
    n, width = batch.input_ids.shape[0], batch.response_mask.shape[1]
    parts: dict[str, list[torch.Tensor]] = {}
    progress = learner.on_progress
    with torch.no_grad(), learner.autocast():
        for rows, real in learner.ranks.micro_batches(n, learner.log_prob_micro):
            out = forward(batch.select(rows).trimmed())
            progress()
            for k, v in out.items():
                v = widen(v, width)
                parts.setdefault(k, []).append(v if real else v[:0])
    joined = {k: torch.cat(v) for k, v in parts.items()}
    return {k: learner.ranks.gather_rows(v, n) for k, v in joined.items()}


def make_experience(learner: Actor, rollout: Rollout) -> Experience:
    """Old and reference log-probs, rewards, advantages and returns of `rollout` (see the module
    docstring); `learner` is the trainer whose models run the forwards."""
    cfg = learner.cfg
    batch = build_token_batch(
        rollout.prompt_ids, rollout.response_ids, learner.pad_id, loss_masks=rollout.loss_masks
    ).to(learner.device)
    mask = batch.response_mask
    fused = learner.fuses_old_log_probs(mask.shape[0])
    lp = log_probs(learner, rollout, batch, fused)
    raw_scores = torch.tensor(rollout.scores, dtype=torch.float32, device=learner.device)
    scores = postprocess_rewards(
        raw_scores,
        cfg.reward_norm,
        cfg.reward_shift,
        cfg.reward_scale,
        cfg.reward_clip,
        rollout.index,
        learner.reward_stats,
    )
    kl = (
        kl_penalty(lp.old_for_ref, lp.ref, cfg.kl_penalty)
        if lp.ref is not None and lp.old_for_ref is not None and not fused
        else None
    )
    token_level_rewards = apply_kl_penalty(scores, mask, kl if cfg.add_token_level_kl else None, learner.kl_ctl.value)
    values = pad_right(rollout.values, mask.shape[1]).to(learner.device) if rollout.values is not None else None
    advantages, returns = compute_advantages(
        cfg.adv_estimator, token_level_rewards, mask, values, rollout.index, cfg.gamma, cfg.lambd
    )
    if cfg.whiten_advantages:
        advantages = masked_whiten(advantages, mask)
    advantages = clip_by_value(advantages, cfg.advantage_clip)
    advantages, distill_metrics = distilled(learner, rollout, advantages, lp, mask)
    seq_kl = masked_mean(kl, mask, dim=-1).mean().item() if kl is not None else 0.0
    rewards = Rewards(raw_scores, scores, token_level_rewards, seq_kl)
    metrics = {
        **experience_metrics(learner, rollout, mask, lp, rewards, advantages, returns, values),
        **distill_metrics,
    }
    return Experience(
        batch,
        lp.old,
        lp.ref,
        advantages,
        returns,
        values,
        metrics,
        lp.rollout_is_weights,
        kl_measured=None if fused else (seq_kl, len(rollout.scores)),
        **teacher_top(learner, rollout, mask.shape[1]),
    )


@dataclass
class LogProbs:
    """The forwards of a batch: the policy's (`cur`: log-probs and entropy; None when fused), the
    old log-probs the update's ratio starts from, the reference's, what the KL to it is taken
    from, and the per-token loss weights of the rollout correction (`rollout_correction`)."""

    cur: dict[str, torch.Tensor] | None
    old: torch.Tensor | None
    ref: torch.Tensor | None
    old_for_ref: torch.Tensor | None
    rollout_is_weights: torch.Tensor | None
    is_metrics: dict


def log_probs(learner: Actor, rollout: Rollout, batch: TokenBatch, fused: bool) -> LogProbs:
    cfg = learner.cfg
    full = cfg.kl_penalty == "full"
    mask = batch.response_mask
    learner.policy.eval()
    cur = None
    if not fused:
        cur = forward_in_micro_batches(
            learner,
            lambda b: response_log_probs(learner.policy, b, learner.temperature, with_entropy=True, full=full),
            batch,
        )
    if cfg.uses_sampler_log_probs and rollout.gen_log_probs is None:
        raise ValueError(
            f"rollout_correction {cfg.rollout_correction_mode} (rollout_correction_metrics: "
            f"{str(cfg.rollout_correction_metrics).lower()}) needs the sampler's log-probs, but this rollout has "
            "no gen_log_probs; set rollout_correction: none (rollout_is: false, rollout_correction_metrics: false) "
            "or have the generation backend return log-probs"
        )
    gen_log_probs = (
        pad_right(rollout.gen_log_probs, mask.shape[1]).to(learner.device)
        if rollout.gen_log_probs is not None
        else None
    )
    if fused:
        old_log_probs = None  # the update takes them from its forward
    elif cfg.recompute_old_log_probs or gen_log_probs is None:
        assert cur is not None  # computed above unless fused
        old_log_probs = cur["log_probs"]
    else:
        old_log_probs = gen_log_probs
    rollout_is_weights, is_metrics = token_weights(learner, rollout, old_log_probs, gen_log_probs, mask)
    old_for_ref = cur["full"] if full and cur is not None else old_log_probs
    ref_log_probs = None
    if cfg.use_kl_loss or cfg.add_token_level_kl:
        sft = (
            forward_in_micro_batches(learner, lambda b: learner.ref_forward(b, full), batch)
            if learner.needs_ref
            else None
        )
        sft_lp = None if sft is None else (sft["full"] if full else sft["log_probs"])
        ref_log_probs = reference_log_probs(cfg.ref_model, sft_lp, old_for_ref, cfg.ref_mix_coef)  # type: ignore[arg-type]
    return LogProbs(cur, old_log_probs, ref_log_probs, old_for_ref, rollout_is_weights, is_metrics)


def token_weights(
    learner: Actor,
    rollout: Rollout,
    old_log_probs: torch.Tensor | None,
    gen_log_probs: torch.Tensor | None,
    mask: torch.Tensor,
) -> tuple[torch.Tensor | None, dict]:
    """The loss's per-token weights (None: none) and their metrics: the rollout correction's
    weights from pi_old / sampler (`rollout_correction`, with its drift metrics), times 0 on tokens
    beyond the staleness bound (a rollout whose tokens are of several versions)."""
    cfg = learner.cfg
    rollout_is_weights: torch.Tensor | None = None
    is_metrics: dict[str, float] = {}
    if cfg.uses_sampler_log_probs:  # with recompute_old_log_probs false, old == sampler's: every weight is 1
        assert old_log_probs is not None and gen_log_probs is not None  # never fused, checked above
        rollout_is_weights, is_metrics = rollout_correction(
            old_log_probs,
            gen_log_probs,
            mask,
            cfg.rollout_correction_mode,
            cfg.rollout_is_threshold,
            cfg.rollout_mask_low,
            cfg.rollout_mask_high,
        )
    if rollout.token_versions is not None:  # tokens of several versions: the staleness bound per token
        versions = pad_right(rollout.token_versions, mask.shape[1], dtype=torch.long)
        fresh, stale_metrics = staleness_weights(versions, learner.policy_version, cfg.max_staleness, mask)
        rollout_is_weights = fresh if rollout_is_weights is None else rollout_is_weights * fresh
        is_metrics = {**is_metrics, **stale_metrics}
    return rollout_is_weights, is_metrics


def distilled(
    learner: Actor, rollout: Rollout, advantages: torch.Tensor, lp: LogProbs, mask: torch.Tensor
) -> tuple[torch.Tensor, dict]:
    """With on-policy distillation (`distill.enabled`), the advantages with the teacher's per-token
    reverse KL added (ppo/distill.py), against the old log-probs (the sampler's when the update
    takes the old ones from its own forward: `fuse_old_log_probs`, as Tinker's recipe does); else
    as they are."""
    d = learner.cfg.distill
    if not d.enabled:
        return advantages, {}
    if rollout.teacher_log_probs is None:
        raise ValueError(
            "distill.enabled: this rollout has no teacher log-probs; every rollout worker needs the same "
            "distill section as the learner (and a teacher server at rpc.teacher with distill.teacher: model)"
        )
    student = lp.old
    if student is None:  # fused: the old log-probs come with the update's forward; the sampler's stand in
        assert rollout.gen_log_probs is not None  # the backends return them (`Completion.log_probs`)
        student = pad_right(rollout.gen_log_probs, mask.shape[1]).to(advantages.device)
    teacher = pad_right(rollout.teacher_log_probs, mask.shape[1]).to(advantages.device)
    return distillation_advantages(advantages, teacher, student, mask, d.kl_coef, d.reward_weight)


def teacher_top(learner: Actor, rollout: Rollout, width: int) -> dict[str, torch.Tensor]:
    """With the top-k forward KL (`distill.forward_kl_coef`), the teacher's top-k tokens and
    log-probs as (B, `width`, k) tensors (zero beyond each response: masked out), each id checked
    to be in the policy's vocabulary; else nothing."""
    d = learner.cfg.distill
    if not (d.enabled and d.forward_kl_coef > 0):
        return {}
    ids, lps = rollout.teacher_top_ids, rollout.teacher_top_log_probs
    if ids is None or lps is None:
        raise ValueError(
            "distill.forward_kl_coef: this rollout has no teacher top-k; every rollout worker needs the same "
            "distill section as the learner (distill.top_k, forward_kl_coef)"
        )
    k = next((len(row) for sample in ids for row in sample), 1)
    out_ids = torch.zeros(len(ids), width, k, dtype=torch.long)
    out_lps = torch.zeros(len(ids), width, k)
    for b, (i, lp) in enumerate(zip(ids, lps)):
        n = min(len(i), width)
        if n:
            out_ids[b, :n] = torch.tensor(i[:n], dtype=torch.long)
            out_lps[b, :n] = torch.tensor(lp[:n], dtype=torch.float32)
    vocab = learner.policy.config.vocab_size
    if out_ids.numel() and int(out_ids.max()) >= vocab:
        raise ValueError(f"a teacher top-k token id {int(out_ids.max())} is beyond the policy's vocabulary ({vocab})")
    return {"teacher_top_ids": out_ids.to(learner.device), "teacher_top_log_probs": out_lps.to(learner.device)}


@dataclass
class Rewards:
    raw_scores: torch.Tensor  # (B,) the reward service's
    scores: torch.Tensor  # (B,) normalised, shifted, scaled, clipped
    token_level: torch.Tensor  # (B, T) with the KL penalty when it is in the reward
    seq_kl: float  # the mean sequence KL to the reference


def experience_metrics(
    learner: Actor,
    rollout: Rollout,
    mask: torch.Tensor,
    lp: LogProbs,
    rewards: Rewards,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor | None,
) -> dict:
    raw_scores = rewards.raw_scores
    metrics = {
        "reward/score_mean": raw_scores.mean().item(),
        "reward/score_std": raw_scores.std().item() if len(raw_scores) > 1 else 0.0,
        "reward/score_min": raw_scores.min().item(),
        "reward/score_max": raw_scores.max().item(),
        "reward/normalized_mean": rewards.scores.mean().item(),
        "reward/token_level_sum_mean": rewards.token_level.sum(-1).mean().item(),
        "ppo/kl_ref": rewards.seq_kl,
        "ppo/kl_coef": learner.kl_ctl.value,
        "ppo/advantages_mean": masked_mean(advantages, mask).item(),
        "ppo/returns_mean": masked_mean(returns, mask).item(),
        "ppo/entropy_rollout": masked_mean(lp.cur["entropy"], mask).item() if lp.cur is not None else float("nan"),
        "rollout/response_length_mean": mask.sum(-1).mean().item(),
        "rollout/samples": len(rollout.scores),
        **lp.is_metrics,
    }
    metrics["ppo/returns_std"] = masked_var(returns, mask).sqrt().item()
    if values is not None:  # how well the critic's values (those the rollout was given) predicted the returns
        metrics["critic/values_mean"] = masked_mean(values, mask).item()
        metrics["critic/explained_variance"] = explained_variance(values, returns, mask)
        metrics["critic/value_error"] = masked_mean((values - returns) ** 2, mask).sqrt().item()
    if rollout.policy_versions and rollout.token_versions is None:  # else per token (`staleness_weights`)
        metrics["rollout/staleness_max"] = max(learner.policy_version - v for v in rollout.policy_versions)
    return metrics
