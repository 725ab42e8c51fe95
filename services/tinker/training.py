"""A Tinker training model: the policy of `model.path` with LoRA adapters of the rank a client asks
for (or all its weights, rank 0), AdamW over what trains, and the gradients forward_backward
accumulates until optim_step spends them.

It is put together from the learner's parts, not a second trainer: PEFT's adapters through
`with_lora` and the optimiser through `optimizer_and_scheduler` (services/learner/trainer.py), the
log-probs through `response_log_probs` (services/common/modeling.py), the LoRA-merged weights a
sampler loads through `merged_lora_weights` (services/learner/lora.py). Everything here runs on the
compute thread.

A datum `(tokens t_0..t_{n-1}, targets y_0..y_{n-1})` is scored as the sequence t_0..t_{n-1}, y_{n-1}
with position j's log-prob read at y_j: the output layer sees every position, each predicting its
own target (the SDK's datums need not be shifted copies of their input)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..common.config_sections import LoraConfig
from ..common.model_files import load_causal_lm, resolve_device
from ..common.modeling import response_log_probs
from ..common.padding import pad_right
from ..common.token_batch import build_token_batch
from ..learner.lora import merged_lora_weights
from ..learner.trainer import optimizer_and_scheduler, with_lora
from .losses import Loss
from .protocol import ApiError
from .wire import Datum, forward_backward_output

if TYPE_CHECKING:
    from ..common.config import Config

# the linear layers each of the SDK's lora_config switches trains (Llama/Qwen/SmolLM names)
LAYERS = {
    "train_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "train_mlp": ("gate_proj", "up_proj", "down_proj"),
    "train_unembed": ("lm_head",),
}


@dataclass(frozen=True)
class ModelSpec:
    """What a training model is: LoRA of `rank` on the layers named `targets` (rank 0: every
    weight trains, no adapters), adapters initialised from `seed`."""

    rank: int
    targets: tuple[str, ...] = ()
    seed: int | None = None

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelSpec":
        return cls(int(d["rank"]), tuple(d.get("targets") or ()), d.get("seed"))


@dataclass(frozen=True)
class Adam:
    """One optim_step's AdamW hyperparameters (grad_clip_norm 0: no clipping)."""

    learning_rate: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    grad_clip_norm: float


@dataclass(frozen=True)
class Call:
    """One forward_backward (or forward) as a training model takes it: the request as the client
    sent it (`body`, the SDK's protobuf: what a trainer in another process reads again), as read
    here, and `op`, the call's name (a trainer answers the same op twice with one result)."""

    body: bytes
    data: list[Datum]
    loss: Loss
    settings: dict[str, float]
    backward: bool
    op: str = ""


def lora_targets(cfg: Config, flags: dict[str, bool]) -> tuple[str, ...]:
    """The layers of `model.path` the SDK's switches select that the model has. The unembedding
    is left out when it shares its weight with the embedding (merging an adapter into it would
    change the embedding too)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(cfg.model.path)
    wanted = [name for flag, names in LAYERS.items() if flags.get(flag, True) for name in names]
    if getattr(config, "tie_word_embeddings", False):
        wanted = [n for n in wanted if n != "lm_head"]
    return tuple(wanted)


class TrainingModel:
    def __init__(self, cfg: Config, spec: ModelSpec):
        self.spec, self.micro = spec, cfg.tinker.micro_batch_size
        self.device = resolve_device(cfg.model.device)
        policy: Any = load_causal_lm(cfg.model.path, self.device)
        self.pad_id = policy.config.pad_token_id if policy.config.pad_token_id is not None else 0
        if spec.rank:
            policy = self._with_adapters(cfg, policy)
        self.policy = policy.eval()  # no dropout: a forward and a forward_backward read the same log-probs
        self.optimizer, _ = optimizer_and_scheduler(
            cfg.model_copy(update={"actor_lr": cfg.tinker.learning_rate, "adam_betas": cfg.tinker.adam_betas}),
            self.policy,
            None,
        )
        self.pending = 0  # datums whose gradients wait for an optim_step
        self.steps = 0

    def _with_adapters(self, cfg: Config, policy):
        present = {name.rsplit(".", 1)[-1] for name, m in policy.named_modules() if isinstance(m, torch.nn.Linear)}
        targets = [t for t in self.spec.targets if t in present]
        if not targets:
            raise ApiError(
                400,
                f"lora_config: none of the layers it selects ({', '.join(self.spec.targets) or 'none'}) is in "
                f"{cfg.model.path}",
                param="lora_config",
            )
        lora = LoraConfig(rank=self.spec.rank, alpha=cfg.tinker.lora_alpha, dropout=0.0, target_modules=targets)
        if self.spec.seed is not None:
            torch.manual_seed(self.spec.seed)
        return with_lora(policy, cfg.model_copy(update={"model": cfg.model.model_copy(update={"lora": lora})}))

    # ------------------------------------------------------------ forward_backward and forward
    def forward_backward(self, call: Call) -> bytes:
        """The call's answer, the SDK's ForwardBackwardOutput (`compute`)."""
        return forward_backward_output(*self.compute(call.data, call.loss, call.settings, call.backward))

    def compute(
        self, data: list[Datum], loss: Loss, settings: dict[str, float], backward: bool
    ) -> tuple[dict[str, list[np.ndarray]], dict[str, float]]:
        """Per datum its targets' log-probs and its per-token loss, and the summed loss; with
        `backward` the gradients of that sum accumulated, a micro-batch at a time."""
        logprobs: list[np.ndarray] = []
        elementwise: list[np.ndarray] = []
        total = 0.0
        for start in range(0, len(data), self.micro):
            chunk = data[start : start + self.micro]
            with torch.set_grad_enabled(backward):
                rows = self._log_probs(chunk)
                losses = [loss.fn(lp, self._inputs(d), settings) for lp, d in zip(rows, chunk)]
                summed = torch.stack([x.sum() for x in losses]).sum()
                if backward:
                    summed.backward()
            total += float(summed.detach())
            logprobs += [lp.detach().float().cpu().numpy() for lp in rows]
            elementwise += [x.detach().float().cpu().numpy() for x in losses]
        if backward:
            self.pending += len(data)
        return {"logprobs": logprobs, "elementwise_loss": elementwise}, {"loss:sum": total}

    def _log_probs(self, data: list[Datum]) -> list[torch.Tensor]:
        targets = [d.inputs["target_tokens"] for d in data]
        batch = build_token_batch(
            [[int(d.tokens[0])] for d in data],
            [[*d.tokens[1:].tolist(), int(t[-1])] for d, t in zip(data, targets)],
            self.pad_id,
        ).to(self.device)
        width = batch.response_mask.shape[1]
        target = pad_right([t.tolist() for t in targets], width, 0, torch.long).to(self.device)
        out = response_log_probs(self.policy, batch, targets=target)["log_probs"]
        return [out[i, : len(d.tokens)] for i, d in enumerate(data)]

    def _inputs(self, d: Datum) -> dict[str, torch.Tensor]:
        return {k: torch.from_numpy(np.array(v)).to(self.device) for k, v in d.inputs.items() if k != "target_tokens"}

    # ------------------------------------------------------------ optim_step
    def optim_step(self, adam: Adam, op: str = "") -> dict[str, float]:
        """One AdamW step with `adam`'s hyperparameters over the accumulated gradients, then none
        (`op`: the call's name, which a trainer in another process needs; here each call is one)."""
        for group in self.optimizer.param_groups:
            group.update(lr=adam.learning_rate, betas=adam.betas, eps=adam.eps, weight_decay=adam.weight_decay)
        params = [p for p in self.policy.parameters() if p.requires_grad]
        limit = adam.grad_clip_norm if adam.grad_clip_norm > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(params, limit))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        datums, self.pending = self.pending, 0
        return {"grad_norm:mean": norm, "step:max": float(self.steps), "datums:sum": float(datums)}

    # ------------------------------------------------------------ weights
    def sampler_weights(self) -> dict[str, torch.Tensor]:
        """What a sampler loads over the base model: each LoRA layer's weight with its adapter
        merged in (the rest is the base), or, full weights, every tensor; float32 on the CPU."""
        if self.spec.rank:
            return {k: v.float() for k, v in merged_lora_weights(self.policy).items()}
        return {k: v.detach().float().cpu().clone() for k, v in self.policy.state_dict().items()}

    def save(self, file: Path) -> None:
        """The model's state written to `file` (save_state, save_weights): what `load` reads."""
        torch.save({**self.state(), "spec": self.spec.as_dict()}, file)

    def load(self, file: Path, optimizer: bool) -> None:
        """The state `save` wrote to `file` over this model (see `load_state`)."""
        self.load_state(torch.load(file, weights_only=True), optimizer)

    def release(self) -> None:
        pass  # its memory goes with the last reference

    def state(self, optimizer: bool = True) -> dict:
        """save_state's content: the trainable tensors and the optimiser's state."""
        trainable = {n: p.detach().cpu().clone() for n, p in self.policy.named_parameters() if p.requires_grad}
        return {"trainable": trainable, "optimizer": self.optimizer.state_dict() if optimizer else None}

    def load_state(self, state: dict, optimizer: bool) -> None:
        """A saved state over this model (of the same spec): its trainable tensors, and with
        `optimizer` its optimiser's state (else the moments start again)."""
        mine = {n: p for n, p in self.policy.named_parameters() if p.requires_grad}
        trainable = state.get("trainable") or {}
        if set(trainable) != set(mine) or any(trainable[n].shape != p.shape for n, p in mine.items()):
            raise ApiError(400, "the checkpoint's trainable tensors are not this model's (another LoRA rank or layers)")
        self.policy.load_state_dict(trainable, strict=False)
        self.optimizer.zero_grad(set_to_none=True)
        self.pending = 0
        if optimizer and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        elif optimizer:
            raise ApiError(400, "the checkpoint holds no optimiser state", param="optimizer")
        else:
            self.optimizer.state.clear()
