"""The critic: a value model and its optimiser. `values` scores states; `train_step` takes one
optimiser step of the (optionally clipped) value loss. The critic server and the in-process
trainer both host this object.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file

from ..common.checkpoints import CriticOptim, read_critic_optim, write_critic_optim
from ..common.model_files import resolve_device
from ..common.modeling import ValueModel, bf16_autocast
from ..common.reward_model_dir import is_ensemble, members, reward_stats
from ..common.sharding.group import ONE_PROCESS, Ranks
from ..common.token_batch import TokenBatch, widen
from ..ppo import AggNorm, compute_value_loss

if TYPE_CHECKING:
    from ..common.config import Config

CHECKPOINT_FILES = ("config.json", "value_head.safetensors", "critic_optim.pt")


class NonFiniteStep(ValueError):
    """A step whose loss or gradient norm is not finite; it was not taken."""


class CheckpointError(ValueError):
    """A critic checkpoint with a missing or unreadable file; nothing was loaded."""


def reward_model_start(path: str, normalize: bool) -> tuple[str, tuple[float, float]]:
    """What a critic starting from the reward model at `path` loads: the model (an ensemble's
    first member) and the (mean, std) its head is rescaled with, the normalisation the reward
    server applies to it (an ensemble's members are always normalised)."""
    if is_ensemble(path):
        first = members(path)[0]
        return str(first), reward_stats(first)
    return path, reward_stats(path) if normalize else (0.0, 1.0)


class Critic:
    def __init__(
        self,
        model_path: str,
        lr: float = 1e-4,
        value_clip: float | None = None,
        loss_agg_mode: str = "token-mean",
        max_grad_norm: float | None = 1.0,
        value_loss_coef: float = 1.0,
        device: str = "auto",
        weight_decay: float = 0.0,
        micro_batch_size: int | None = None,
        bf16: bool = False,
        gradient_checkpointing: bool = False,
        reward_model_head: tuple[float, float] | None = None,
        ranks: Ranks = ONE_PROCESS,
    ):
        """`reward_model_head`: `model_path` is a reward model whose head starts the value head,
        rescaled with this (mean, std) (`ValueModel.from_reward_model`); None: a model directory
        with a value head or none (a zero head). `ranks`: the processes a step's rows are split
        across (`common.sharding.group`; the sharded critic's process group)."""
        self.device, self.ranks = resolve_device(device), ranks
        self.lr, self.weight_decay = lr, weight_decay
        self.bf16, self.gradient_checkpointing = bf16, gradient_checkpointing
        model = (
            ValueModel.from_pretrained(model_path)
            if reward_model_head is None
            else ValueModel.from_reward_model(model_path, *reward_model_head)
        )
        self.model = self._prepare(model.to(self.load_device))
        self.optimizer = self._optimizer(self.model)
        self.value_clip, self.loss_agg_mode = value_clip, loss_agg_mode
        self.max_grad_norm, self.value_loss_coef = max_grad_norm, value_loss_coef
        self.micro_batch_size = micro_batch_size  # rows per forward (and backward); None: the whole batch
        self.steps = 0

    @property
    def load_device(self) -> torch.device:
        """Where the model is loaded (a sharded critic loads on the CPU and moves only its shards)."""
        return self.device

    @classmethod
    def from_config(cls, cfg: Config, **kwargs) -> "Critic":
        path, head = cfg.critic.model_path or cfg.model.path, None
        if cfg.critic.init_from_reward_model:
            assert cfg.reward.model_path is not None, "the config's validation asks for it"
            path, head = reward_model_start(cfg.reward.model_path, cfg.reward.model_normalize)
        return cls(
            path,
            lr=cfg.critic.lr,
            value_clip=cfg.value_clip,
            loss_agg_mode=cfg.loss_agg_mode,
            max_grad_norm=cfg.max_grad_norm,
            value_loss_coef=cfg.critic.value_loss_coef,
            device=cfg.model.device,
            weight_decay=cfg.weight_decay,
            micro_batch_size=cfg.critic.micro_batch_size or cfg.micro_batch_size,
            bf16=cfg.model.bf16,
            gradient_checkpointing=cfg.model.gradient_checkpointing,
            reward_model_head=head,
            **kwargs,
        )

    def _prepare(self, model: ValueModel) -> ValueModel:
        if self.gradient_checkpointing:  # a transformers model's (nn.Module's attributes type as Tensor | Module)
            getattr(model.backbone, "gradient_checkpointing_enable")()
        return model

    @property
    def _param_device(self) -> torch.device:
        return self.model.value_head.weight.device

    def _optimizer(self, model: ValueModel) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=self.weight_decay)

    @torch.no_grad()
    def values(self, batch: TokenBatch) -> torch.Tensor:
        """V(s_t) per response position: (B, T), 0 where `response_mask` is 0; in micro-batches."""
        self.model.eval()
        n, width = batch.input_ids.shape[0], batch.response_mask.shape[1]
        parts = []
        with bf16_autocast(self.device, self.bf16):
            for rows, real in self.ranks.micro_batches(n, self.micro_batch_size or n):
                v = self.model.response_values(batch.select(rows).trimmed().to(self._param_device)).float()
                parts.append(widen(v, width)[: None if real else 0])
        return self.ranks.gather_rows(torch.cat(parts), n).cpu()

    def train_step(self, batch: TokenBatch, returns: torch.Tensor, old_values: torch.Tensor) -> dict:
        """One optimiser step on a mini-batch, its gradient accumulated over micro-batches (each
        loss weighted by its share of the mini-batch in `loss_agg_mode`: equal to one pass).
        returns, old_values: (B, T). A non-finite loss or gradient norm raises `NonFiniteStep`
        and leaves weights, optimiser and step count as they were."""
        self.model.train()
        n, device = batch.input_ids.shape[0], self._param_device
        norm = AggNorm(batch.response_mask)
        self.optimizer.zero_grad(set_to_none=True)
        loss = clipfrac = vpred_sum = tokens = 0.0
        for rows, real in self.ranks.micro_batches(n, self.micro_batch_size or n):
            sub = batch.select(rows).trimmed().to(device)
            t = sub.response_mask.shape[1]
            with bf16_autocast(self.device, self.bf16):
                vpreds = self.model.response_values(sub)
            vf_loss, vf_clipfrac = compute_value_loss(
                vpreds,
                returns[rows, :t].to(device),
                old_values[rows, :t].to(device),
                sub.response_mask,
                self.value_clip,
                self.loss_agg_mode,
            )
            scale = norm.scale(sub.response_mask, self.loss_agg_mode) if real else 0.0
            # FSDP averages the processes' gradients: each process's share is scaled up by N
            (self.value_loss_coef * vf_loss * scale * self.ranks.world).backward()
            if real:
                mask = sub.response_mask.float()
                loss += vf_loss.item() * scale
                clipfrac += vf_clipfrac.item() * float(mask.sum())
                vpred_sum += float((vpreds.detach().float() * mask).sum())
                tokens += float(mask.sum())
        total = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm or float("inf"))
        grad_norm = float(total.full_tensor() if hasattr(total, "full_tensor") else total)  # a DTensor under FSDP
        loss, clipfrac, vpred_sum, tokens = self.ranks.all_sum([loss, clipfrac, vpred_sum, tokens])
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteStep(f"critic step skipped: loss {loss}, gradient norm {grad_norm}")
        self.optimizer.step()
        self.steps += 1
        return {
            "critic/vf_loss": loss,
            "critic/vf_clipfrac": clipfrac / max(tokens, 1.0),
            "critic/vpred_mean": vpred_sum / max(tokens, 1.0),
            "critic/grad_norm": grad_norm,
        }

    def save(self, path: str | Path) -> None:
        path = Path(path)
        self.model.save_pretrained(path)
        write_critic_optim(path, CriticOptim(self.steps, state=self.optimizer.state_dict()))

    def load(self, path: str | Path) -> None:
        """Weights, optimiser state and step count from `path`, all or nothing: everything is read
        into fresh objects and checked against this critic before it is swapped in."""
        path = Path(path)
        for name in CHECKPOINT_FILES:
            if not (path / name).is_file():
                raise CheckpointError(f"{name}: missing")
        try:
            load_file(str(path / "value_head.safetensors"))
        except Exception as e:
            raise CheckpointError(f"value_head.safetensors: cannot be read ({type(e).__name__}: {e})") from None
        try:
            model = self._prepare(ValueModel.from_pretrained(path).to(self.device))
        except Exception as e:
            raise CheckpointError(f"backbone model files: cannot be read ({type(e).__name__}: {e})") from None
        live = {k: (v.shape, v.dtype) for k, v in self.model.state_dict().items()}
        if {k: (v.shape, v.dtype) for k, v in model.state_dict().items()} != live:
            raise CheckpointError("model weights: names, shapes or dtypes differ from this critic's model")
        optimizer = self._optimizer(model)
        try:
            saved = read_critic_optim(path, map_location=self.device)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        try:
            if saved.sharded is not None:  # written by a sharded critic (critic.nproc > 1)
                from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

                from ..common.sharding.fsdp import read_sharded_optimizer

                shards = read_sharded_optimizer(model, optimizer, path / saved.sharded)
                set_optimizer_state_dict(model, optimizer, shards)
            else:
                optimizer.load_state_dict(saved.state or {})
        except Exception as e:
            raise CheckpointError(f"critic_optim.pt: cannot be read ({type(e).__name__}: {e})") from None
        steps = saved.steps
        for p, s in optimizer.state.items():
            if any(torch.is_tensor(v) and v.dim() and v.shape != p.shape for v in s.values()):
                raise CheckpointError("critic_optim.pt: optimiser state does not fit the model's parameters")
        self.model, self.optimizer, self.steps = model, optimizer, steps
