"""The learner's PPO step: from a batch of scored rollouts to one policy update.

    rollout --make_experience--> old/ref log-probs, token rewards (+KL), advantages, returns
            --update-----------> ppo_epochs x mini-batches of (policy loss + KL loss - entropy
                                 + PTX loss), each followed by a critic step on the same rows

The in-process trainer and the learner service both call `PPOLearner.step`; the critic is any
object with `train_step` (the in-process `Critic`, a gRPC client, or `OverlappedCritic`, whose
steps are futures so the critic server trains while the actor does; `update` waits for all of
them before it returns).
"""
from __future__ import annotations

import contextlib
import copy
import math
import random
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from ..common.data import sft_examples
from ..common.distributed import collective
from ..common.hostcopy import to_host
from ..common.modeling import (TokenBatch, build_token_batch, has_dropout, load_causal_lm, response_log_probs,
                               resolve_device)
from ..common.padding import pad_right
from ..common.types import Rollout
from ..ppo import (POLICY_LOSSES, RunningMeanStd, agg_loss, apply_kl_penalty, clip_by_value, compute_advantages,
                   compute_sft_loss, kl_penalty, make_kl_controller, masked_mean, masked_whiten,
                   postprocess_rewards, reference_log_probs, rollout_importance_weights)
from .lora import merged_lora_weights, merged_state_dict


ADAPTER_DIR = "adapter"  # with LoRA: the PEFT adapter beside the merged model in final/


@dataclass
class Experience:
    batch: TokenBatch
    old_log_probs: torch.Tensor | None  # (B, T); None: taken from the training forward (`fuses_old_log_probs`)
    ref_log_probs: torch.Tensor | None  # (B, T), or (B, T, V) for kl_penalty 'full'
    advantages: torch.Tensor  # (B, T)
    returns: torch.Tensor  # (B, T)
    values: torch.Tensor | None  # (B, T)
    metrics: dict
    rollout_is_weights: torch.Tensor | None = None  # (B, T) truncated pi_old / sampler weights (rollout_is)


def ptx_examples_for(cfg, tokenizer, records) -> list | None:
    """(prompt ids, answer ids) pairs for the PTX/SFT loss: the labelled training prompts."""
    if not cfg.ptx_coef:
        return None
    return sft_examples(tokenizer, records)


class PPOLearner:
    """Owns the actor, the reference model, the optimiser, the KL controller and the running
    reward statistics. `cfg` is the validated `Config`."""

    def __init__(self, cfg, total_updates: int | None = None, ptx_examples=None, dist=None):
        self.cfg = cfg
        self.dist = dist  # `distributed.Dist` when the actor is sharded across processes (FSDP2)
        self.device = resolve_device(cfg.model.device)
        if dist is not None:
            self.device = dist.device
            if cfg.model.lora.rank > 0:
                raise ValueError("model.lora with model.nproc > 1 is not supported: LoRA adapters of a model that "
                                 "fits one device train in one process (model.nproc: 1)")
        if dist is None:
            self.policy = load_causal_lm(cfg.model.path, self.device)
        else:  # loaded by rank 0 on the CPU, broadcast into every process's shards on its device
            self.policy = self._load_sharded()
        self.pad_id = self.policy.config.pad_token_id if self.policy.config.pad_token_id is not None else 0
        self.lora = cfg.model.lora.rank > 0
        if self.lora:
            from peft import LoraConfig, get_peft_model
            lc = cfg.model.lora
            self.policy = get_peft_model(self.policy, LoraConfig(r=lc.rank, lora_alpha=lc.alpha, lora_dropout=lc.dropout,
                                                                 target_modules=list(lc.target_modules)))
        if cfg.model.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable()
            if self.lora:
                self.policy.enable_input_require_grads()
        self.needs_ref = (cfg.use_kl_loss or cfg.add_token_level_kl) and cfg.ref_model != "policy"
        self.ref = None
        if self.needs_ref and not self.lora and dist is None:  # with LoRA: the base with adapters off
            self.ref = copy.deepcopy(self.policy).eval().requires_grad_(False)
        if dist is not None and self.needs_ref:  # after the policy: one full copy on the host at a time
            self.ref = self._load_sharded().eval().requires_grad_(False)
        params = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.actor_lr, betas=tuple(cfg.adam_betas),
                                           weight_decay=cfg.weight_decay)
        from transformers import get_scheduler
        self.scheduler = get_scheduler(cfg.lr_scheduler, self.optimizer, num_warmup_steps=cfg.lr_warmup_steps,
                                       num_training_steps=max(total_updates or 1, 1))
        self.kl_ctl = make_kl_controller(cfg.init_kl_coef, cfg.target_kl, cfg.kl_horizon)
        self.reward_stats = RunningMeanStd()
        self.ptx_examples = list(ptx_examples or [])
        self.rng = random.Random(cfg.run.seed)
        self.version = 0
        self.temperature = cfg.generation.temperature
        # the old log-probs equal the training forward's (verl's on-policy shortcut) when the only
        # optimiser step comes after every forward, and nothing before the update needs them
        self._fusable = (cfg.fuse_old_log_probs and cfg.recompute_old_log_probs and cfg.ppo_epochs == 1
                         and not cfg.add_token_level_kl and not cfg.rollout_is and cfg.kl_penalty != "full"
                         and (cfg.ref_model == "sft" or not cfg.use_kl_loss) and not has_dropout(self.policy))
        self.forwards_saved = 0

    def _load_sharded(self):
        from ..common.distributed import load_and_shard
        from ..common.modeling import empty_causal_lm
        path = self.cfg.model.path
        return load_and_shard(lambda: load_causal_lm(path, "cpu"), lambda: empty_causal_lm(path), self.dist)

    def fuses_old_log_probs(self, batch_size: int) -> bool:
        """Whether a batch of `batch_size` takes its old log-probs from the training forward: true
        with `fuse_old_log_probs` when the batch is one mini-batch of one epoch (its forwards all
        run before the optimiser step), the reward has no KL term, the reference is the SFT model,
        `kl_penalty` is not 'full', `rollout_is` is off and the model has no dropout."""
        return self._fusable and batch_size <= self.cfg.ppo_mini_batch_size

    # ---------------------------------------------------------------- forward passes
    def _autocast(self):
        if self.cfg.model.bf16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _ref_forward(self, batch: TokenBatch, full: bool):
        with torch.no_grad(), self._autocast():
            if self.lora:
                with self.policy.disable_adapter():
                    return response_log_probs(self.policy, batch, self.temperature, full=full)
            return response_log_probs(self.ref, batch, self.temperature, full=full)

    def _by_rows(self, forward, batch: TokenBatch) -> dict:
        """`forward(batch)` without gradients; with N processes each runs its share of the rows
        and every process gets the whole result."""
        with torch.no_grad(), self._autocast():
            if self.dist is None:
                return forward(batch)
            n = batch.input_ids.shape[0]
            rows, real = self.dist.local_rows(n)
            out = forward(batch.select(rows))
            return {k: self.dist.gather_rows(v[:real].contiguous(), n) for k, v in out.items() if torch.is_tensor(v)}

    # ---------------------------------------------------------------- experience
    def make_experience(self, rollout: Rollout) -> Experience:
        cfg = self.cfg
        full = cfg.kl_penalty == "full"
        batch = build_token_batch(rollout.prompt_ids, rollout.response_ids, self.pad_id).to(self.device)
        mask = batch.response_mask
        T = mask.shape[1]
        fused = self.fuses_old_log_probs(mask.shape[0])
        self.policy.eval()
        cur = None
        if fused:
            self.forwards_saved += 1
        else:
            cur = self._by_rows(lambda b: response_log_probs(self.policy, b, self.temperature, with_entropy=True,
                                                             full=full), batch)
        if cfg.rollout_is and rollout.gen_log_probs is None:
            raise ValueError("rollout_is needs the sampler's log-probs, but this rollout has no gen_log_probs; "
                             "set rollout_is: false or have the generation backend return log-probs")
        gen_log_probs = pad_right(rollout.gen_log_probs, T).to(self.device) \
            if rollout.gen_log_probs is not None else None
        if fused:
            old_log_probs = None  # the update takes them from its forward
        elif cfg.recompute_old_log_probs or gen_log_probs is None:
            old_log_probs = cur["log_probs"]
        else:
            old_log_probs = gen_log_probs
        rollout_is_weights, is_metrics = None, {}
        if cfg.rollout_is:  # with recompute_old_log_probs false, old == sampler's: every weight is 1
            rollout_is_weights, is_metrics = rollout_importance_weights(old_log_probs, gen_log_probs, mask,
                                                                        cfg.rollout_is_threshold)
        old_for_ref = cur["full"] if full and cur is not None else old_log_probs
        ref_log_probs = None
        if cfg.use_kl_loss or cfg.add_token_level_kl:
            sft = self._by_rows(lambda b: self._ref_forward(b, full), batch) if self.needs_ref else None
            sft_lp = None if sft is None else (sft["full"] if full else sft["log_probs"])
            ref_log_probs = reference_log_probs(cfg.ref_model, sft_lp, old_for_ref, cfg.ref_mix_coef)

        raw_scores = torch.tensor(rollout.scores, dtype=torch.float32, device=self.device)
        scores = postprocess_rewards(raw_scores, cfg.reward_norm, cfg.reward_shift, cfg.reward_scale,
                                     cfg.reward_clip, rollout.index, self.reward_stats)
        kl = kl_penalty(old_for_ref, ref_log_probs, cfg.kl_penalty) \
            if ref_log_probs is not None and not fused else None
        token_level_rewards = apply_kl_penalty(scores, mask, kl if cfg.add_token_level_kl else None,
                                               self.kl_ctl.value)
        values = pad_right(rollout.values, T).to(self.device) if rollout.values is not None else None
        advantages, returns = compute_advantages(cfg.adv_estimator, token_level_rewards, mask, values,
                                                 rollout.index, cfg.gamma, cfg.lambd)
        if cfg.whiten_advantages:
            advantages = masked_whiten(advantages, mask)
        advantages = clip_by_value(advantages, cfg.advantage_clip)

        seq_kl = masked_mean(kl, mask, dim=-1).mean().item() if kl is not None else 0.0
        lengths = mask.sum(-1)
        metrics = {
            "reward/score_mean": raw_scores.mean().item(), "reward/score_std": raw_scores.std().item()
            if len(raw_scores) > 1 else 0.0, "reward/score_min": raw_scores.min().item(),
            "reward/score_max": raw_scores.max().item(), "reward/normalized_mean": scores.mean().item(),
            "reward/token_level_sum_mean": token_level_rewards.sum(-1).mean().item(),
            "ppo/kl_ref": seq_kl, "ppo/kl_coef": self.kl_ctl.value,
            "ppo/advantages_mean": masked_mean(advantages, mask).item(),
            "ppo/returns_mean": masked_mean(returns, mask).item(),
            "ppo/entropy_rollout": masked_mean(cur["entropy"], mask).item() if cur is not None else float("nan"),
            "rollout/response_length_mean": lengths.mean().item(),
            "rollout/samples": len(rollout.scores),
            **is_metrics,
        }
        if values is not None:
            metrics["critic/values_mean"] = masked_mean(values, mask).item()
        if rollout.versions:
            metrics["rollout/staleness_max"] = max(self.version - v for v in rollout.versions)
        if not fused:  # else the update measures the KL and updates the controller
            self.kl_ctl.update(seq_kl, n_steps=len(rollout.scores))
        return Experience(batch, old_log_probs, ref_log_probs, advantages, returns, values, metrics,
                          rollout_is_weights)

    # ---------------------------------------------------------------- update
    def _ptx_loss(self, picks: list) -> torch.Tensor | None:
        if not picks:
            return None
        b = build_token_batch([p for p, _ in picks], [a for _, a in picks], self.pad_id).to(self.device)
        lp = response_log_probs(self.policy, b)["log_probs"]
        return compute_sft_loss(lp, b.response_mask)

    def _micro_batches(self, idx: torch.Tensor, micro: int) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
        """(rows, positions in `idx`, real) of each micro-batch this process runs for mini-batch
        `idx`. With N processes each takes its share of the rows; every process runs as many
        micro-batches (a process short of rows runs a weightless one), so their collectives pair up."""
        positions = torch.arange(len(idx))
        if self.dist is None:
            return [(idx[s:s + micro], positions[s:s + micro], True) for s in range(0, len(idx), micro)]
        start, end = self.dist.rows(len(idx))
        most = -(-len(idx) // self.dist.world)
        out = []
        for s in range(0, most, micro):
            pos = positions[start + s:min(start + s + micro, end)]
            out.append((idx[pos], pos, True) if len(pos) else (idx[:1], positions[:1], False))
        return out

    def update(self, exp: Experience, critic=None) -> dict:
        cfg = self.cfg
        full = cfg.kl_penalty == "full"
        B = exp.batch.input_ids.shape[0]
        mb = min(cfg.ppo_mini_batch_size, B)
        micro = min(cfg.micro_batch_size or mb, mb)
        world = self.dist.world if self.dist is not None else 1
        sums: dict[str, float] = {}
        weights: dict[str, float] = {}

        def add(k, v, w):  # a micro-batch's value, weighted by its rows
            sums[k] = sums.get(k, 0.0) + float(v) * w
            weights[k] = weights.get(k, 0.0) + w

        policy_loss = POLICY_LOSSES.get(cfg.policy_loss)
        fused = exp.old_log_probs is None
        if fused and (cfg.ppo_epochs != 1 or B > mb):
            raise ValueError("old log-probs from the training forward need one epoch of one mini-batch")
        rollout_stats = [0.0, 0.0, 0.0, 0.0]  # entropy sum, tokens, sequence KL sum, sequences (fused)
        critic_steps: list = []
        g = torch.Generator().manual_seed(self.rng.randrange(2 ** 31))
        self.policy.train()
        for _ in range(cfg.ppo_epochs):
            perm = torch.randperm(B, generator=g)
            for start in range(0, B, mb):
                idx = perm[start:start + mb]
                picks = [self.rng.choice(self.ptx_examples) for _ in range(len(idx))] \
                    if cfg.ptx_coef and self.ptx_examples else []
                self.optimizer.zero_grad(set_to_none=True)
                bad_loss = None  # a non-finite loss on any process's rows stops every process alike
                for m, pos, real in self._micro_batches(idx, micro):
                    w = len(m) if real else 0
                    sub = exp.batch.select(m)
                    mask = sub.response_mask
                    with self._autocast():
                        out = response_log_probs(self.policy, sub, self.temperature, with_entropy=True, full=full)
                    log_prob = out["log_probs"]
                    if fused:
                        old = log_prob.detach()
                        if real:
                            self._rollout_stats(rollout_stats, out, old, exp, m, mask)
                    else:
                        old = exp.old_log_probs[m]
                    pg_loss, clipfrac, ppo_kl, clipfrac_lower = policy_loss(
                        old, log_prob, exp.advantages[m], mask,
                        cliprange_low=cfg.clip_low, cliprange_high=cfg.clip_high,
                        clip_ratio_c=cfg.dual_clip_c if cfg.dual_clip_loss else None,
                        loss_agg_mode=cfg.loss_agg_mode,
                        rollout_is_weights=None if exp.rollout_is_weights is None else exp.rollout_is_weights[m])
                    loss = pg_loss
                    entropy = agg_loss(out["entropy"], mask, cfg.loss_agg_mode)
                    if cfg.entropy_coef:
                        loss = loss - cfg.entropy_coef * entropy
                    if cfg.use_kl_loss and exp.ref_log_probs is not None:
                        cur = out["full"] if full else log_prob
                        kl_loss = agg_loss(kl_penalty(cur, exp.ref_log_probs[m], cfg.kl_penalty), mask,
                                           cfg.loss_agg_mode)
                        loss = loss + cfg.kl_loss_coef * kl_loss
                        add("ppo/kl_loss", kl_loss.item(), w)
                    ptx = self._ptx_loss([picks[i] for i in pos.tolist()] if picks else [])
                    if ptx is not None:
                        loss = loss + cfg.ptx_coef * ptx
                        add("ppo/ptx_loss", ptx.item(), w)
                    if real and not torch.isfinite(loss):
                        bad_loss = loss.item()
                    # FSDP averages the processes' gradients: each weighs its rows' share x N
                    (loss * (w * world / len(idx))).backward()
                    add("ppo/pg_loss", pg_loss.item(), w)
                    add("ppo/pg_clipfrac", clipfrac.item(), w)
                    add("ppo/pg_clipfrac_lower", clipfrac_lower.item(), w)
                    add("ppo/approx_kl", ppo_kl.item(), w)
                    add("ppo/entropy_loss", entropy.item(), w)  # as the loss aggregates it
                    add("ppo/entropy", masked_mean(out["entropy"].detach(), mask).item(), w)  # per token
                if self.dist is not None:
                    bad_loss = float("nan") if self.dist.all_sum([bad_loss is not None])[0] else None
                if bad_loss is not None:
                    self.optimizer.zero_grad(set_to_none=True)
                    raise FloatingPointError(f"non-finite policy loss {bad_loss} at version {self.version}")
                params = [p for p in self.policy.parameters() if p.requires_grad]
                grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm or float("inf"))
                if hasattr(grad_norm, "full_tensor"):  # a DTensor (FSDP): the norm over every shard
                    grad_norm = grad_norm.full_tensor()
                add("ppo/grad_norm", float(grad_norm), len(idx) / world)
                if math.isfinite(float(grad_norm)):
                    self.optimizer.step()
                self.scheduler.step()
                if critic is not None and exp.values is not None:
                    critic_steps.append(critic.train_step(exp.batch.select(idx).to("cpu"), exp.returns[idx].cpu(),
                                                          exp.values[idx].cpu()))
        for step in critic_steps:  # a remote critic may return futures: it trains while the actor does
            for k, v in (step.result() if isinstance(step, Future) else step).items():
                add(k, v, 1.0)
        self.policy.eval()
        self.version += 1
        if self.dist is not None:  # the averages over every process's rows
            keys = sorted(k for k in sums if not k.startswith("critic/"))
            totals = self.dist.all_sum([sums[k] for k in keys] + [weights[k] for k in keys] + rollout_stats)
            n = len(keys)
            sums.update(zip(keys, totals[:n]))
            weights.update(zip(keys, totals[n:2 * n]))
            rollout_stats = totals[2 * n:]
        metrics = {k: sums[k] / weights[k] for k in sums if weights[k]}
        metrics["ppo/lr"] = self.scheduler.get_last_lr()[0]
        if fused:  # what make_experience measures on its own forward otherwise
            seq_kl = rollout_stats[2] / rollout_stats[3] if rollout_stats[3] else 0.0
            metrics["ppo/entropy_rollout"] = rollout_stats[0] / max(rollout_stats[1], 1.0)
            metrics["ppo/kl_ref"] = seq_kl
            self.kl_ctl.update(seq_kl, n_steps=B)
        return metrics

    def _rollout_stats(self, stats: list, out: dict, old: torch.Tensor, exp: Experience, m, mask) -> None:
        """Accumulate the rollout's entropy and KL to the reference from the training forward of
        micro-batch `m` (the fused old log-probs), as `make_experience` measures them."""
        with torch.no_grad():
            maskf = mask.to(out["entropy"].dtype)
            stats[0] += float((out["entropy"].detach().float() * maskf).sum())
            stats[1] += float(maskf.sum())
            if exp.ref_log_probs is not None:
                kl = masked_mean(kl_penalty(old, exp.ref_log_probs[m], self.cfg.kl_penalty), mask, dim=-1)
                stats[2] += float(kl.sum())
                stats[3] += len(m)

    @collective
    def step(self, rollout: Rollout, critic=None) -> dict:
        exp = self.make_experience(rollout)
        metrics = dict(exp.metrics)
        metrics.update(self.update(exp, critic))
        return metrics

    # ---------------------------------------------------------------- weights and state
    @collective
    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """Full policy weights under the plain model's names (LoRA merged in), on the CPU. Sharded:
        gathered on rank 0 (the other ranks get {})."""
        if self.dist is not None:
            from ..common.distributed import full_state_dict
            return full_state_dict(self.policy, pinned=True)
        if not self.lora:
            return to_host(self.policy.state_dict())  # from a GPU through page-locked memory
        return merged_state_dict(self.policy)

    def policy_delta_state_dict(self) -> dict[str, torch.Tensor]:
        """With LoRA, only the tensors training changes: each LoRA-targeted module's weight with the
        adapters merged in, under the plain model's names, on the CPU (equal to those entries of
        `policy_state_dict`); every other tensor is the frozen base. Without LoRA, the full state."""
        return merged_lora_weights(self.policy) if self.lora else self.policy_state_dict()

    @collective
    def save_policy(self, path: str | Path, tokenizer=None) -> None:
        path = Path(path)
        model = self.policy
        if self.dist is not None:  # the gathered weights, written by rank 0
            from ..common.distributed import full_state_dict
            state = full_state_dict(self.policy)
            if self.dist.main:
                self.policy.save_pretrained(str(path), state_dict=state)
                if tokenizer is not None:
                    tokenizer.save_pretrained(str(path))
            return
        if self.lora:  # the merged model, and the adapter itself in adapter/ (what PEFT loads)
            self.policy.save_pretrained(str(path / ADAPTER_DIR))
            model = copy.deepcopy(self.policy).merge_and_unload()
        model.save_pretrained(str(path))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(path))

    @property
    def sharded(self) -> bool:
        return self.dist is not None

    def state_dict(self) -> dict:
        """The learner's state. A sharded learner leaves the actor and its optimiser state out:
        `save_actor` writes them, each process its shards."""
        actor = {} if self.sharded else {"policy": self.policy.state_dict(), "optimizer": self.optimizer.state_dict()}
        return {**actor, "scheduler": self.scheduler.state_dict(), "kl_ctl": self.kl_ctl.state_dict(),
                "reward_stats": self.reward_stats.state_dict(), "version": self.version,
                "rng": self.rng.getstate()}

    @collective
    def save_actor(self, path: str | Path) -> None:
        """The actor and its optimiser state as a torch.distributed.checkpoint directory (every
        process writes its shards; any number of processes loads it)."""
        from ..common.distributed import save_sharded
        save_sharded(self.policy, self.optimizer, Path(path))

    @collective
    def load_state_dict(self, state: dict, actor: str | Path | None = None) -> None:
        """Restore `state_dict()`; the actor from `state` (a one-process checkpoint) or from the
        directory `actor` (`save_actor`'s, written by any number of processes)."""
        from ..common.distributed import load_full, load_sharded
        if "policy" not in state:
            if actor is None or not Path(actor).is_dir():
                raise FileNotFoundError(f"the checkpoint has no actor: {actor} is missing")
            load_sharded(self.policy, self.optimizer, Path(actor))
        elif self.sharded:
            load_full(self.policy, self.optimizer, state)
        else:
            self.policy.load_state_dict(state["policy"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.reward_stats.load_state_dict(state["reward_stats"])
        self.version = int(state["version"])
        self.rng.setstate(state["rng"])
