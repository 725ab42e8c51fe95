"""The policy trainer across N processes (GPUs), sharded with FSDP2 (model.nproc, or
`rlhf serve learner --nproc N`). Rank 0 is the learner service; its calls (a step, the full state
dict for a push, saving the policy, a sharded checkpoint and its load) are announced to ranks
1..N-1, which run them on their shards (`services/common/sharding/`). Each rank computes its
share of every batch's rows; FSDP2 averages the gradients, so an update equals the one-process
update on the same batch.

The actor and the reference are loaded by rank 0 alone (on the CPU) and broadcast into every
process's shards on its device (`load_and_shard`). A checkpoint holds the actor and its optimiser
state sharded (`save_actor`: a torch.distributed.checkpoint directory, which any number of
processes loads); a one-process checkpoint loads here too (its tensors put onto the shards).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..common.model_files import empty_causal_lm, load_causal_lm, save_model_dir
from ..common.sharding.followers import collective
from ..common.sharding.fsdp import full_state_dict, load_and_shard, load_full
from ..common.sharding.group import Dist
from ..common.types import Progress, Rollout, no_progress
from ..weights.hostcopy import to_host
from .trainer import PolicyTrainer

if TYPE_CHECKING:
    from ..common.config import Config


class ShardedPolicyTrainer(PolicyTrainer):
    sharded = True

    def __init__(
        self,
        cfg: Config,
        total_updates: int | None = None,
        ptx_examples=None,
        on_progress: Progress = no_progress,
        *,
        dist: Dist,
    ):
        if cfg.model.lora.rank > 0:
            raise ValueError(
                "model.lora with model.nproc > 1 is not supported: LoRA adapters of a model that "
                "fits one device train in one process (model.nproc: 1)"
            )
        self.dist = dist  # read by `collective`, `follow` and `release_followers` too
        super().__init__(cfg, total_updates, ptx_examples, on_progress, ranks=dist)

    # ---------------------------------------------------------------- the models
    def _device(self) -> torch.device:
        return self.dist.device  # this process's GPU (LOCAL_RANK) or the CPU

    def _load_model(self, path: str | None = None) -> torch.nn.Module:
        """Loaded by rank 0 on the CPU, broadcast into every process's shards on its device."""
        path = path or self.cfg.model.path
        return load_and_shard(lambda: load_causal_lm(path, "cpu"), lambda: empty_causal_lm(path), self.dist)

    def _reference(self) -> torch.nn.Module | None:
        """Loaded and sharded as the policy, after it (model.reference_path when set): one full copy
        on the host at a time."""
        if not self.needs_ref:
            return None
        return self._load_model(self.cfg.model.reference_path).eval().requires_grad_(False)

    # ---------------------------------------------------------------- the calls every rank runs
    @collective
    def step(self, rollout: Rollout, critic=None) -> dict:
        return super().step(rollout, critic)

    @collective
    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """Full policy weights on the CPU, gathered on rank 0 (the other ranks get {})."""
        return full_state_dict(self.policy, to_host=to_host)

    @collective
    def save_policy(self, path: str | Path, tokenizer=None) -> None:
        """The gathered weights, written by rank 0."""
        path = Path(path)
        state = full_state_dict(self.policy)
        if self.dist.main:
            save_model_dir(self.policy, path, tokenizer, state_dict=state)

    def _actor_state(self) -> dict:
        return {}  # `save_actor` writes the actor and its optimiser state, each process its shards

    @collective
    def save_actor(self, path: str | Path) -> None:
        super().save_actor(path)

    @collective
    def load_state_dict(self, state: dict, actor: str | Path | None = None) -> None:
        super().load_state_dict(state, actor)

    def _load_actor(self, state: dict, actor: str | Path | None) -> None:
        if "policy" in state:  # a one-process checkpoint: its full tensors go to the shards
            load_full(self.policy, self.optimizer, state)
        else:
            super()._load_actor(state, actor)
