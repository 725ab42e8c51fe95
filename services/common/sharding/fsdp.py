"""A model's shards and its state (FSDP2): sharding it, loading it with one full copy on the host,
its full state dict, and its checkpoints, sharded or full."""

from __future__ import annotations

import contextlib
import logging
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from .group import Dist

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import OptimizerStateType

log = logging.getLogger(__name__)


def shard(model: torch.nn.Module, mesh=None) -> torch.nn.Module:
    """FSDP2: every block transformers says not to split (`_no_split_modules` of the model or of a
    backbone inside it: the decoder layers) is a unit of its own, then the root (embeddings, final
    norm, heads). Parameters on the CPU move to the mesh's device shard by shard."""
    from torch.distributed.fsdp import fully_shard

    names = {n for m in model.modules() for n in (getattr(m, "_no_split_modules", None) or [])}
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        log.warning(
            "%s names no blocks to shard (_no_split_modules): the whole model is one FSDP unit, "
            "gathered whole in every forward",
            type(model).__name__,
        )
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def load_and_shard(load, build_empty, d: "Dist") -> torch.nn.Module:
    """A model sharded across the group with one full copy on the host in all: rank 0 loads it on
    the CPU (`load()`), every other rank builds it on the meta device (`build_empty()`: the same
    architecture, no memory); all shard it; the others allocate their shards on their device;
    then rank 0's weights are broadcast into every rank's shards, and its buffers (the
    non-persistent ones too, such as rotary frequencies) into every rank's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if d.main:
        model = load()
        full = dict(model.state_dict())  # keeps the loaded weights alive through sharding
    else:
        with torch.device("meta"):
            model = build_empty()
        full = {}
    shard(model, d.mesh())
    if not d.main:
        model.to_empty(device=d.device)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    with torch.no_grad():
        for buf in model.buffers():
            dist.broadcast(buf, src=0)
    return model


def full_state_dict(model: torch.nn.Module, to_host=None) -> dict[str, torch.Tensor]:
    """The whole model's weights on the CPU, on rank 0 (other ranks get {}); collective. With
    `to_host` (a push: `weights.hostcopy.to_host`, through page-locked memory), GPU tensors come to
    the host through it, one gathered tensor at a time, as torch's own gather does into pageable
    memory (4-5x slower)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if to_host is None:
        # full (not sharded) and on the CPU: plain tensors
        return cast(
            "dict[str, torch.Tensor]",
            get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)),
        )
    from torch.distributed.tensor import DTensor

    main, out = dist.get_rank() == 0, {}
    for name, t in model.state_dict().items():
        if isinstance(t, DTensor):
            t = t.full_tensor()  # on every rank
        elif main:
            t = t.detach().clone()  # not a view of the live model
        if main:
            out.update(to_host({name: t}))
    return out


@contextlib.contextmanager
def quiet_single_process():
    """torch.distributed.checkpoint in one process warns that it assumes one process: it does."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def save_sharded(model, optimizer, path: Path) -> None:
    """Model and optimiser state as a torch.distributed.checkpoint directory: each rank writes its
    shards; any number of processes can load it (resharded)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    with quiet_single_process():
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))


def load_sharded(model, optimizer, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": msd, "optim": osd}
    with quiet_single_process():
        dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def read_sharded_optimizer(model, optimizer, path: Path) -> dict:
    """The optimiser state saved sharded in the directory `path` (torch.distributed.checkpoint),
    read for `optimizer` (this process's shards, or all of it in one process) without applying it;
    `set_optimizer_state_dict` applies it. A missing or unreadable directory is a ValueError."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if not path.is_dir():
        raise ValueError(f"{path.name}/: missing")
    state = {"optim": get_optimizer_state_dict(model, optimizer)}
    try:
        with quiet_single_process():
            dcp.load(state, checkpoint_id=str(path))
    except BaseException as e:  # torch.distributed.checkpoint's CheckpointException is not an Exception
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise ValueError(f"{path.name}/: cannot be read ({type(e).__name__})") from None
    return state["optim"]


def load_full(model, optimizer, state: dict) -> None:
    """A single-process checkpoint (`policy`, `optimizer` state dicts) into a sharded learner:
    the full tensors (every rank reads them) go to the shards; the optimiser state is mapped by
    the parameters' order."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state["policy"], options=StateDictOptions(full_state_dict=True))
    load_full_optimizer(model, optimizer, state["optimizer"])


def load_full_optimizer(model, optimizer, saved: dict) -> None:
    """A one-process `optimizer.state_dict()` (keyed by parameter order) into a sharded one."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    names = [n for n, p in model.named_parameters() if p.requires_grad]
    osd: OptimizerStateType = {
        "state": {names[int(i)]: s for i, s in saved["state"].items()},
        "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in saved["param_groups"]],
    }
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, osd, options=StateDictOptions(full_state_dict=True))
