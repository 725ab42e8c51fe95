"""The critic's value model across N processes (GPUs), sharded with FSDP2 (critic.nproc, or
`rlhf serve critic --nproc N`). Rank 0 serves gRPC; its calls (values, a train step, save, load)
are announced to ranks 1..N-1, which run them on their shards (`services/common/sharding/`).
Each rank computes its share of a batch's rows; a step equals the one-process step.

A checkpoint holds the whole value model as the one-process critic writes it (config, backbone
weights, value_head.safetensors), so any number of processes loads it, and the optimiser state
sharded in `optim/` (torch.distributed.checkpoint); `critic_optim.pt` says so. A one-process
checkpoint loads here too (its optimiser state mapped onto the shards).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..common.checkpoints import CriticOptim, read_critic_optim, write_critic_optim
from ..common.model_files import save_model_dir
from ..common.modeling import ValueModel
from ..common.sharding.followers import collective
from ..common.sharding.fsdp import (
    full_state_dict,
    load_full_optimizer,
    quiet_single_process,
    read_sharded_optimizer,
    shard,
)
from ..common.token_batch import TokenBatch
from .critic import CHECKPOINT_FILES, CheckpointError, Critic

if TYPE_CHECKING:
    from ..common.config import Config

OPTIM_DIR = "optim"


class ShardedCritic(Critic):
    def __init__(self, *args, dist, **kwargs):
        import warnings

        # the value model returns a slice of its head's output; nothing writes into it in place
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        self.dist = dist
        super().__init__(*args, ranks=dist, **kwargs)

    @classmethod
    def from_config(cls, cfg: Config, **kwargs) -> "ShardedCritic":
        """`dist=`: this process's group."""
        critic = super().from_config(cfg, **kwargs)
        assert isinstance(critic, ShardedCritic)
        return critic

    @property
    def load_device(self) -> torch.device:
        return torch.device("cpu")  # sharding moves each process's shards to its device

    def _optimizer(self, model: ValueModel) -> torch.optim.Optimizer:
        if not getattr(model, "_sharded", False):
            shard(model, self.dist.mesh())
            setattr(model, "_sharded", True)  # once per model (the optimiser is rebuilt on load)
        return super()._optimizer(model)

    @collective
    def values(self, batch: TokenBatch) -> torch.Tensor:
        return super().values(batch)

    @collective
    def train_step(self, batch: TokenBatch, returns: torch.Tensor, old_values: torch.Tensor) -> dict:
        return super().train_step(batch, returns, old_values)

    @collective
    def save(self, path: str | Path) -> None:
        """Rank 0 writes the gathered model; every rank its optimiser shards. A failure on any
        rank (a path that cannot be a directory, a full disk) is raised on every rank before the
        next collective, so the group stays in step."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        path = Path(path)
        failed: OSError | None = None
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            failed = e
        state = full_state_dict(self.model)
        if self.dist.main and failed is None:
            try:
                self._write_model(path, state)
            except OSError as e:
                failed = e
        if self.dist.all_sum([failed is not None])[0]:
            raise failed or OSError(f"another process could not write {path}")
        with quiet_single_process():
            dcp.save(
                {"optim": get_optimizer_state_dict(self.model, self.optimizer)}, checkpoint_id=str(path / OPTIM_DIR)
            )
        if self.dist.main:
            write_critic_optim(path, CriticOptim(self.steps, sharded=OPTIM_DIR))

    def _write_model(self, path: Path, state: dict) -> None:
        from safetensors.torch import save_file

        backbone = {k.removeprefix("backbone."): v for k, v in state.items() if k.startswith("backbone.")}
        save_model_dir(self.model.backbone, path, state_dict=backbone)
        head = {k.removeprefix("value_head."): v.contiguous() for k, v in state.items() if k.startswith("value_head.")}
        save_file(head, str(path / "value_head.safetensors"))

    @collective
    def load(self, path: str | Path) -> None:
        """Weights (full, every rank reads them), optimiser state and step count from `path`; all
        checks come first, so a checkpoint that fails them changes nothing (on every rank alike)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(path)
        for name in CHECKPOINT_FILES:
            if not (path / name).is_file():
                raise CheckpointError(f"{name}: missing")
        try:
            loaded = ValueModel.from_pretrained(path)
        except Exception as e:
            raise CheckpointError(f"model files: cannot be read ({type(e).__name__}: {e})") from None
        full = loaded.state_dict()
        live = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}  # a DTensor's shape is the full one
        if {k: tuple(v.shape) for k, v in full.items()} != live:
            raise CheckpointError("model weights: names or shapes differ from this critic's model")
        try:
            saved = read_critic_optim(path)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        steps = saved.steps
        optim = None
        if saved.sharded is not None:  # read before anything changes
            try:
                optim = read_sharded_optimizer(self.model, self.optimizer, path / saved.sharded)
            except ValueError as e:
                raise CheckpointError(str(e)) from None
        set_model_state_dict(self.model, full, options=StateDictOptions(full_state_dict=True))
        if optim is not None:
            set_optimizer_state_dict(self.model, self.optimizer, optim)
        else:
            load_full_optimizer(self.model, self.optimizer, saved.state or {})
        self.steps = steps
