"""The policy's trainer: `PolicyTrainer` holds the models, the optimiser and the learner's state
(the KL controller, the reward statistics, the version), and runs the PPO step, whose parts are
modules of their own that take what they read and return what they measure:

    rollout --experience.py:make_experience--> old/ref log-probs, token rewards (+KL), advantages,
                                               returns (and the KL measured, for the controller)
            --update.py:run_update-----------> ppo_epochs x mini-batches of (policy loss + KL loss
                                               - entropy + PTX loss, ppo/objective.py), each followed
                                               by a critic step on the same rows; its metrics

The trainer takes what the two measured into its state (`make_experience`, `update`).

The in-process trainer and the learner service both call `PolicyTrainer.step`; the critic is any
object with `train_step` (the in-process `Critic`, a gRPC client, or `OverlappedCritic`, whose
steps are futures so the critic server trains while the actor does; `update` waits for all of
them before it returns).

This is the one-process trainer; `sharded.py` has `ShardedPolicyTrainer`, the same trainer with
its models sharded across processes (FSDP2, model.nproc > 1). The update and the experience
reach the other processes only through the trainer's `ranks` (`common.sharding.group.Ranks`:
`ONE_PROCESS` here, the process group there), as the critic does.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..common.model_files import load_causal_lm, resolve_device, save_model_dir
from ..common.modeling import bf16_autocast, has_dropout, response_log_probs
from ..common.sharding.group import ONE_PROCESS, Ranks
from ..common.token_batch import TokenBatch
from ..common.types import Progress, Rollout, no_progress
from ..ppo import RunningMeanStd, make_kl_controller
from ..ppo.objective import ObjectiveSettings
from ..training.data import sft_examples
from ..weights.hostcopy import to_host
from .experience import Experience, make_experience
from .lora import merged_lora_weights, merged_state_dict
from .update import run_update

if TYPE_CHECKING:
    from ..common.config import Config


ADAPTER_DIR = "adapter"  # with LoRA: the PEFT adapter beside the merged model in final/


def ptx_examples_for(cfg: Config, tokenizer, records) -> list | None:
    """(prompt ids, answer ids) pairs for the PTX/SFT loss: the labelled training prompts."""
    if not cfg.ptx_coef:
        return None
    return sft_examples(tokenizer, records)


def with_lora(policy, cfg: Config) -> Any:
    """`policy` inside PEFT's model with the LoRA adapters of `model.lora`."""
    from peft import LoraConfig, get_peft_model

    lc = cfg.model.lora
    return get_peft_model(
        policy,
        LoraConfig(
            r=lc.rank,
            lora_alpha=lc.alpha,  # type: ignore[arg-type]  # peft annotates int, takes a float
            lora_dropout=lc.dropout,
            target_modules=list(lc.target_modules),
        ),
    )


def optimizer_and_scheduler(cfg: Config, policy, total_updates: int | None) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW over the policy's trainable parameters, and its LR scheduler (`lr_scheduler`, a
    transformers one) over `total_updates` steps."""
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(
        params, lr=cfg.actor_lr, betas=(cfg.adam_betas[0], cfg.adam_betas[1]), weight_decay=cfg.weight_decay
    )
    from transformers import get_scheduler

    scheduler = get_scheduler(
        cfg.lr_scheduler,
        optimizer,
        num_warmup_steps=cfg.lr_warmup_steps,
        num_training_steps=max(total_updates or 1, 1),
    )
    return optimizer, scheduler


def old_log_probs_fusable(cfg: Config, policy) -> bool:
    """Whether the configuration lets a batch take its old log-probs from the training forward
    (`PolicyTrainer.fuses_old_log_probs` adds the batch's size)."""
    # the old log-probs equal the training forward's (verl's on-policy shortcut) when the only
    # optimiser step comes after every forward, and nothing before the update needs them
    return (
        cfg.fuse_old_log_probs
        and cfg.recompute_old_log_probs
        and cfg.ppo_epochs == 1
        and not cfg.add_token_level_kl
        and not cfg.uses_sampler_log_probs
        and cfg.kl_penalty != "full"
        and (cfg.ref_model == "sft" or not cfg.use_kl_loss)
        and not has_dropout(policy)
    )


class PolicyTrainer:
    """Owns the actor, the reference model, the optimiser, the KL controller and the running
    reward statistics. `cfg` is the validated `Config`."""

    sharded = False  # ShardedPolicyTrainer: the actor and its optimiser state split across processes

    def __init__(
        self,
        cfg: Config,
        total_updates: int | None = None,
        ptx_examples=None,
        on_progress: Progress = no_progress,
        ranks: Ranks = ONE_PROCESS,
    ):
        """`on_progress`: called at each micro-batch forward and optimiser step; `ranks`: the
        processes a step's rows are split across (`common.sharding.group`)."""
        self.cfg, self.on_progress, self.ranks = cfg, on_progress, ranks
        self.device = self._device()
        self.policy: Any = self._load_model()  # a transformers model, or PEFT's around it (LoRA)
        self.pad_id = self.policy.config.pad_token_id if self.policy.config.pad_token_id is not None else 0
        self.lora = cfg.model.lora.rank > 0
        if self.lora:
            self.policy = with_lora(self.policy, cfg)
        if cfg.model.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable()
            if self.lora:
                self.policy.enable_input_require_grads()
        self.needs_ref = (cfg.use_kl_loss or cfg.add_token_level_kl) and cfg.ref_model != "policy"
        self.ref = self._reference()
        self.optimizer, self.scheduler = optimizer_and_scheduler(cfg, self.policy, total_updates)
        self.kl_ctl = make_kl_controller(cfg.init_kl_coef, cfg.target_kl, cfg.kl_horizon)
        self.reward_stats = RunningMeanStd()
        self.ptx_examples = list(ptx_examples or [])
        self.rng = random.Random(cfg.run.seed)
        self.policy_version = 0
        self.temperature = cfg.generation.temperature
        self._fusable = old_log_probs_fusable(cfg, self.policy)
        self.forwards_saved = 0
        self.objective = ObjectiveSettings.from_config(cfg)
        micro = cfg.micro_batch_size or cfg.ppo_mini_batch_size
        self.log_prob_micro = cfg.log_prob_micro_batch_size or micro  # rows per no-grad forward

    # ---------------------------------------------------------------- the models (ShardedPolicyTrainer overrides)
    def _device(self) -> torch.device:
        return resolve_device(self.cfg.model.device)

    def _load_model(self) -> Any:  # a transformers PreTrainedModel
        """The SFT model (`model.path`) on this trainer's device: the policy's starting weights."""
        return load_causal_lm(self.cfg.model.path, self.device)

    def _reference(self) -> torch.nn.Module | None:
        """The frozen reference model, if the KL terms need one: `model.reference_path` when set (a
        run branched from another's policy keeps the original SFT model), else a copy of the policy
        as loaded (with LoRA none: the reference is the base with the adapters off)."""
        if self.needs_ref and self.cfg.model.reference_path:
            if self.lora:
                raise ValueError(
                    "model.reference_path with LoRA: the reference is the base model with the adapters "
                    "off; leave model.reference_path unset"
                )
            return load_causal_lm(self.cfg.model.reference_path, self.device).eval().requires_grad_(False)
        if self.needs_ref and not self.lora:
            return copy.deepcopy(self.policy).eval().requires_grad_(False)
        return None

    def fuses_old_log_probs(self, batch_size: int) -> bool:
        """Whether a batch of `batch_size` takes its old log-probs from the training forward: true
        with `fuse_old_log_probs` when the batch is one mini-batch of one epoch (its forwards all
        run before the optimiser step), the reward has no KL term, the reference is the SFT model,
        `kl_penalty` is not 'full', no rollout correction (nor its metrics) compares the sampler's
        log-probs with the old ones and the model has no dropout."""
        return self._fusable and batch_size <= self.cfg.ppo_mini_batch_size

    # ---------------------------------------------------------------- forward passes
    def autocast(self):
        return bf16_autocast(self.device, self.cfg.model.bf16)

    def ref_forward(self, batch: TokenBatch, full: bool):
        """Log-probs of the reference (the frozen SFT model; with LoRA the base, adapters off)."""
        with torch.no_grad(), self.autocast():
            if self.lora:
                with self.policy.disable_adapter():
                    return response_log_probs(self.policy, batch, self.temperature, full=full)
            assert self.ref is not None  # needs_ref: loaded
            return response_log_probs(self.ref, batch, self.temperature, full=full)

    # the step: experience, then the update; what they measure, the trainer's state takes here
    def make_experience(self, rollout: Rollout) -> Experience:
        exp = make_experience(self, rollout)
        if exp.kl_measured is not None:
            self.kl_ctl.update(exp.kl_measured[0], n_steps=exp.kl_measured[1])
        else:  # the old log-probs (and the KL) come with the update's forward
            self.forwards_saved += 1
        return exp

    def update(self, exp: Experience, critic=None) -> dict:
        metrics = run_update(self, exp, critic)
        if exp.kl_measured is None:
            self.kl_ctl.update(metrics["ppo/kl_ref"], n_steps=exp.batch.input_ids.shape[0])
        return metrics

    def step(self, rollout: Rollout, critic=None) -> dict:
        exp = self.make_experience(rollout)
        metrics = dict(exp.metrics)
        metrics.update(self.update(exp, critic))
        return metrics

    # ---------------------------------------------------------------- weights and state
    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """Full policy weights under the plain model's names (LoRA merged in), on the CPU."""
        if not self.lora:
            return to_host(self.policy.state_dict())  # from a GPU through page-locked memory
        return merged_state_dict(self.policy)

    def policy_delta_state_dict(self) -> dict[str, torch.Tensor]:
        """With LoRA, only the tensors training changes: each LoRA-targeted module's weight with the
        adapters merged in, under the plain model's names, on the CPU (equal to those entries of
        `policy_state_dict`); every other tensor is the frozen base. Without LoRA, the full state."""
        return merged_lora_weights(self.policy) if self.lora else self.policy_state_dict()

    def save_policy(self, path: str | Path, tokenizer=None) -> None:
        path = Path(path)
        model = self.policy
        if self.lora:  # the merged model, and the adapter itself in adapter/ (what PEFT loads)
            self.policy.save_pretrained(str(path / ADAPTER_DIR))
            model = copy.deepcopy(self.policy).merge_and_unload()
        save_model_dir(model, path, tokenizer)

    def restore_policy(self, path: str | Path) -> None:
        """The policy's weights from a Hugging Face directory (a run's `best/`, or the SFT model),
        the optimiser's moments dropped (they pointed away from it). One process, no LoRA."""
        if self.lora or self.sharded:
            raise ValueError("restoring the policy from a directory needs a one-process learner without LoRA")
        weights = load_causal_lm(path, self.device).state_dict()
        self.policy.load_state_dict(weights)
        self.optimizer.state.clear()

    def state_dict(self) -> dict:
        """The learner's state. A sharded learner leaves the actor and its optimiser state out:
        `save_actor` writes them, each process its shards."""
        return {
            **self._actor_state(),
            "scheduler": self.scheduler.state_dict(),
            "kl_ctl": self.kl_ctl.state_dict(),
            "reward_stats": self.reward_stats.state_dict(),
            "version": self.policy_version,  # the checkpoint's key, kept: older checkpoints load
            "rng": self.rng.getstate(),
        }

    def _actor_state(self) -> dict:
        return {"policy": self.policy.state_dict(), "optimizer": self.optimizer.state_dict()}

    def save_actor(self, path: str | Path) -> None:
        """The actor and its optimiser state as a torch.distributed.checkpoint directory (every
        process writes its shards; any number of processes loads it)."""
        from ..common.sharding.fsdp import save_sharded

        save_sharded(self.policy, self.optimizer, Path(path))

    def load_state_dict(self, state: dict, actor: str | Path | None = None) -> None:
        """Restore `state_dict()`; the actor from `state` (a one-process checkpoint) or from the
        directory `actor` (`save_actor`'s, written by any number of processes)."""
        self._load_actor(state, actor)
        self.scheduler.load_state_dict(state["scheduler"])
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.reward_stats.load_state_dict(state["reward_stats"])
        self.policy_version = int(state["version"])
        self.rng.setstate(state["rng"])

    def _load_actor(self, state: dict, actor: str | Path | None) -> None:
        if "policy" not in state:
            from ..common.sharding.fsdp import load_sharded

            if actor is None or not Path(actor).is_dir():
                raise FileNotFoundError(f"the checkpoint has no actor: {actor} is missing")
            load_sharded(self.policy, self.optimizer, Path(actor))
        else:
            self.policy.load_state_dict(state["policy"])
            self.optimizer.load_state_dict(state["optimizer"])
