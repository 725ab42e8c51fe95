"""The PPO update: `ppo_epochs` passes over the experience in shuffled mini-batches; each
mini-batch is one optimiser step of the objective (`ppo.objective`) accumulated over
micro-batches of `micro_batch_size` rows (padding columns trimmed), followed by a critic step
on the same rows. Accumulation is exact: each micro-batch's loss is weighted by its share of
the mini-batch in the `loss_agg_mode`, so the step equals one pass over the whole mini-batch.
With N processes (`ShardedPolicyTrainer`) each runs its share of every mini-batch's rows, through
the trainer's `ranks` (`common.sharding.group.Ranks`).
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..common.modeling import response_log_probs
from ..common.token_batch import build_token_batch
from ..ppo import AggNorm, compute_sft_loss, kl_penalty, masked_mean
from ..ppo.objective import ppo_objective
from .experience import Actor, Experience

if TYPE_CHECKING:
    from ..common.config import Config


class Metrics:
    """Each mini-batch's value of a metric (the sum over its micro-batches of value x share of the
    mini-batch), averaged over the mini-batches."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self._open: dict[str, float] = {}

    def add(self, key: str, value: float, share: float) -> None:
        self._open[key] = self._open.get(key, 0.0) + float(value) * share

    def close(self) -> None:
        """The end of a mini-batch."""
        for k, v in self._open.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
            self.counts[k] = self.counts.get(k, 0) + 1
        self._open = {}

    def means(self) -> dict[str, float]:
        return {k: self.sums[k] / self.counts[k] for k in self.sums}


def ptx_loss(learner: Actor, picks: list) -> torch.Tensor | None:
    """The PTX/SFT loss of (prompt ids, answer ids) pairs under the policy (None for none)."""
    if not picks:
        return None
    b = build_token_batch([p for p, _ in picks], [a for _, a in picks], learner.pad_id).to(learner.device)
    lp = response_log_probs(learner.policy, b)["log_probs"]
    return compute_sft_loss(lp, b.response_mask)


def run_update(learner: Actor, exp: Experience, critic=None) -> dict:
    """Train the policy (and the critic) on `exp`; returns the update's metrics. Names carry their
    scope: `b_` the whole batch, `mb_` a mini-batch (one optimiser step), `micro_` a micro-batch."""
    cfg = learner.cfg
    b_size = exp.batch.input_ids.shape[0]
    mb_size = min(cfg.ppo_mini_batch_size, b_size)
    micro_size = min(cfg.micro_batch_size or mb_size, mb_size)
    metrics = Metrics()
    fused = exp.old_log_probs is None
    if fused and (cfg.ppo_epochs != 1 or b_size > mb_size):
        raise ValueError("old log-probs from the training forward need one epoch of one mini-batch")
    rollout_stats = RolloutStats()  # with fused old log-probs: what make_experience measures otherwise
    critic_steps: list = []
    g = torch.Generator().manual_seed(learner.rng.randrange(2**31))
    b_lengths = length_keys(exp.batch)
    learner.policy.train()
    for _ in range(cfg.ppo_epochs):
        b_perm = torch.randperm(b_size, generator=g)
        for start in range(0, b_size, mb_size):
            mb_rows = b_perm[start : start + mb_size]
            mb_rows = mb_rows[torch.sort(b_lengths[mb_rows], stable=True).indices]
            mini_batch_step(learner, exp, mb_rows, micro_size, metrics, rollout_stats if fused else None)
            if critic is not None and exp.values is not None:
                critic_steps.append(
                    critic.train_step(
                        exp.batch.select(mb_rows).to("cpu"), exp.returns[mb_rows].cpu(), exp.values[mb_rows].cpu()
                    )
                )
    for step in critic_steps:  # a remote critic may return futures: it trains while the actor does
        for k, v in (step.result() if isinstance(step, Future) else step).items():
            metrics.add(k, v, 1.0)  # rank 0 alone runs the critic steps
        metrics.close()
        learner.on_progress()
    learner.policy.eval()
    # the averages over every process's rows
    keys = sorted(k for k in metrics.sums if not k.startswith("critic/"))  # every process has these
    totals = learner.ranks.all_sum([metrics.sums[k] for k in keys] + rollout_stats.sums())
    metrics.sums.update(zip(keys, totals[: len(keys)]))
    rollout_stats = RolloutStats(*totals[len(keys) :])
    out = metrics.means()
    out["ppo/lr"] = learner.scheduler.get_last_lr()[0]
    if fused:  # what make_experience measures on its own forward otherwise
        out["ppo/entropy_rollout"], out["ppo/kl_ref"] = rollout_stats.entropy(), rollout_stats.seq_kl()
    return out


def length_keys(batch) -> torch.Tensor:
    """A sort key per row: rows of like length share a micro-batch (each is trimmed to its
    longest row), so the padding left is what the lengths differ by within a micro-batch, not
    across the mini-batch. Responses vary most: by response length, then prompt length (a
    response's length is every token it holds, the environment's too, which its loss mask leaves
    out of the loss). On the CPU, as the permutation it sorts (the batch may be on the GPU)."""
    prompt_width, attn = batch.prompt_width, batch.attention_mask
    return (attn[:, prompt_width:].sum(1).long() * (prompt_width + 1) + attn[:, :prompt_width].sum(1)).cpu()


def mini_batch_step(
    learner: Actor,
    exp: Experience,
    mb_rows: torch.Tensor,
    micro_size: int,
    metrics: Metrics,
    rollout_stats: RolloutStats | None,
) -> None:
    """One optimiser step on the rows `mb_rows` of `exp`: the objective's gradient accumulated
    over micro-batches (each weighted by its share of the mini-batch), clipped, stepped; with fused
    old log-probs (`rollout_stats` given) the old log-probs are the forward's own."""
    cfg = learner.cfg
    world = learner.ranks.world
    norm = AggNorm(exp.batch.response_mask[mb_rows])
    picks = (
        [learner.rng.choice(learner.ptx_examples) for _ in range(len(mb_rows))]
        if cfg.ptx_coef and learner.ptx_examples
        else []
    )
    learner.optimizer.zero_grad(set_to_none=True)
    bad_loss = None  # a non-finite loss on any process's rows stops every process alike
    for micro_pos, real in learner.ranks.micro_batches(len(mb_rows), micro_size):
        loss, terms = micro_batch_loss(learner, exp, mb_rows, micro_pos, real, norm, picks, rollout_stats)
        if real and not torch.isfinite(loss):
            bad_loss = loss.item()
        # FSDP averages the processes' gradients: each process's share is scaled up by N
        (loss * (world if real else 0.0)).backward()
        if real:
            for k, (v, w) in terms.items():
                metrics.add(k, v, w)
        learner.on_progress()
    optimizer_step(learner, metrics, bad_loss)


def micro_batch_loss(
    learner: Actor,
    exp: Experience,
    mb_rows: torch.Tensor,
    micro_pos: torch.Tensor,
    real: bool,
    norm: AggNorm,
    picks: list,
    rollout_stats: RolloutStats | None,
) -> tuple[torch.Tensor, dict]:
    """The objective and its terms on the micro-batch at `micro_pos` of the mini-batch `mb_rows`
    (its padding columns trimmed), from the policy's forward on it; `real`: rows of this process's
    share (not padding of an uneven split); `picks`: the mini-batch's PTX examples."""
    cfg = learner.cfg
    full = cfg.kl_penalty == "full"
    micro_rows = mb_rows[micro_pos]
    micro_batch = exp.batch.select(micro_rows).trimmed()
    micro_width = micro_batch.response_mask.shape[1]
    top_ids = None if exp.teacher_top_ids is None else exp.teacher_top_ids[micro_rows, :micro_width]
    with learner.autocast():
        out = response_log_probs(
            learner.policy, micro_batch, learner.temperature, with_entropy=True, full=full, gather_ids=top_ids
        )
    log_prob = out["log_probs"]
    if rollout_stats is not None:  # fused: the old log-probs are this forward's
        old = log_prob.detach()
        if real:
            rollout_stats.add(cfg, out, old, exp, micro_rows, micro_batch.response_mask, micro_width)
    else:
        assert exp.old_log_probs is not None  # not fused
        old = exp.old_log_probs[micro_rows, :micro_width]
    ptx = ptx_loss(learner, [picks[i] for i in micro_pos.tolist()] if picks else [])
    return ppo_objective(
        learner.objective,
        log_prob,
        out["entropy"],
        old,
        exp.advantages[micro_rows, :micro_width],
        micro_batch.response_mask,
        norm,
        ref_log_prob=None if exp.ref_log_probs is None else exp.ref_log_probs[micro_rows, :micro_width],
        kl_input=out.get("full"),
        rollout_is_weights=None if exp.rollout_is_weights is None else exp.rollout_is_weights[micro_rows, :micro_width],
        ptx_loss=ptx,
        ptx_share=len(micro_rows) / len(mb_rows),
        student_top=out.get("gathered_log_probs"),
        teacher_top=None if exp.teacher_top_log_probs is None else exp.teacher_top_log_probs[micro_rows, :micro_width],
    )


def optimizer_step(learner: Actor, metrics: Metrics, bad_loss: float | None) -> None:
    """The mini-batch's step, its gradient accumulated: refused on every process when any
    process's loss was not finite (`bad_loss`); else the gradient clipped (its norm measured) and
    stepped when finite; the scheduler steps either way."""
    cfg = learner.cfg
    world = learner.ranks.world
    if learner.ranks.all_sum([bad_loss is not None])[0] and bad_loss is None:
        bad_loss = float("nan")  # another process's rows
    if bad_loss is not None:
        learner.optimizer.zero_grad(set_to_none=True)
        raise FloatingPointError(f"non-finite policy loss {bad_loss} at version {learner.policy_version}")
    params = [p for p in learner.policy.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm or float("inf"))
    if hasattr(grad_norm, "full_tensor"):  # a DTensor (FSDP): the norm over every shard
        grad_norm = grad_norm.full_tensor()
    metrics.add("ppo/grad_norm", float(grad_norm), 1.0 / world)  # the same on every process
    metrics.close()
    if math.isfinite(float(grad_norm)):
        learner.optimizer.step()
    learner.scheduler.step()
    learner.on_progress()


@dataclass
class RolloutStats:
    """The rollout's entropy and KL to the reference, summed over the training forward's
    micro-batches (the fused old log-probs), as `make_experience` measures them on its own."""

    entropy_sum: float = 0.0
    tokens: float = 0.0
    seq_kl_sum: float = 0.0
    sequences: float = 0.0

    def add(
        self, cfg: Config, out: dict, old: torch.Tensor, exp: Experience, micro_rows, mask, micro_width: int
    ) -> None:
        """A micro-batch: the rows `micro_rows` of `exp`, `micro_width` response positions wide."""
        with torch.no_grad():
            maskf = mask.to(out["entropy"].dtype)
            self.entropy_sum += float((out["entropy"].detach().float() * maskf).sum())
            self.tokens += float(maskf.sum())
            if exp.ref_log_probs is not None:
                ref = exp.ref_log_probs[micro_rows, :micro_width]
                kl = masked_mean(kl_penalty(old, ref, cfg.kl_penalty), mask, dim=-1)
                self.seq_kl_sum += float(kl.sum())
                self.sequences += len(micro_rows)

    def sums(self) -> list[float]:
        """In a fixed order, to be summed across processes (`RolloutStats(*totals)`)."""
        return [self.entropy_sum, self.tokens, self.seq_kl_sum, self.sequences]

    def entropy(self) -> float:
        return self.entropy_sum / max(self.tokens, 1.0)

    def seq_kl(self) -> float:
        return self.seq_kl_sum / self.sequences if self.sequences else 0.0
