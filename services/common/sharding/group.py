"""The process group of a sharded model (`Dist`, from torchrun's environment) and the rows of a
batch each rank runs.

`Ranks` is how a trainer (the actor's `PolicyTrainer`, the `Critic`) reaches the other processes:
its `world`, the `micro_batches` it runs, `all_sum` and `gather_rows`. A one-process trainer holds
`ONE_PROCESS`; a sharded one its `Dist`. Nothing else of a step knows whether it is sharded."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)

CONTROL_TIMEOUT = timedelta(days=30)  # followers wait on the control channel as long as rank 0 waits for data
# the collectives of a step, a push or a checkpoint: followers may wait in one while rank 0 waits
# for its critic server (rpc.dependency_wait_s); a dead process is noticed by the watchdog
# (`start_followers`) or by the backend, not by this timeout
DATA_TIMEOUT = timedelta(hours=2)


class Ranks(Protocol):
    """The processes a step's rows are split across (see the module docstring)."""

    @property
    def world(self) -> int:
        """FSDP averages the processes' gradients: each one's loss is scaled up by this."""
        ...

    def micro_batches(self, n: int, size: int) -> list[tuple[torch.Tensor, bool]]:
        """The row positions of each micro-batch of at most `size` rows (of `n`) this process runs,
        and whether it counts (`micro_batches` below)."""
        ...

    def all_sum(self, values: list[float]) -> list[float]:
        """Element-wise sums of `values` over the processes."""
        ...

    def gather_rows(self, local: torch.Tensor, n: int) -> torch.Tensor:
        """The (n, ...) tensor of every process's rows (`local`: this process's micro-batches' rows)."""
        ...


class OneProcess:
    """Every row of a batch is in this process."""

    world = 1

    def micro_batches(self, n: int, size: int) -> list[tuple[torch.Tensor, bool]]:
        return micro_batches(n, size)

    def all_sum(self, values: list[float]) -> list[float]:
        return values

    def gather_rows(self, local: torch.Tensor, n: int) -> torch.Tensor:
        return local


ONE_PROCESS = OneProcess()


@dataclass
class Dist:
    rank: int
    world: int
    local_rank: int
    control: ProcessGroup  # the gloo process group of the control channel and the metric reductions
    device_type: str = "cpu"
    _mesh: DeviceMesh | None = None

    def mesh(self) -> DeviceMesh:
        """The 1-D device mesh FSDP shards over: this group on `device_type` (FSDP's default
        would take any accelerator present, even for a CPU run)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(self.device_type, (self.world,))
        return self._mesh

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        """This process's device: its GPU (LOCAL_RANK) or the CPU."""
        return torch.device("cuda", self.local_rank) if self.device_type == "cuda" else torch.device("cpu")

    def announce(self, name: str, kwargs: dict | None = None) -> None:
        dist.broadcast_object_list([(name, kwargs or {})], src=0, group=self.control)

    def receive(self) -> tuple[str, dict]:
        box: list[tuple[str, dict] | None] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return cast("tuple[str, dict]", box[0])  # rank 0's `announce`

    def all_sum(self, values: list[float]) -> list[float]:
        """Element-wise sums over the ranks (on the control group: CPU tensors on any backend)."""
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=self.control)
        return t.tolist()

    def rows(self, n: int) -> tuple[int, int]:
        """This rank's [start, end) of `n` rows split as evenly as possible (earlier ranks take
        one more when it does not divide)."""
        base, extra = divmod(n, self.world)
        start = self.rank * base + min(self.rank, extra)
        return start, start + base + (self.rank < extra)

    def micro_batches(self, n: int, size: int) -> list[tuple[torch.Tensor, bool]]:
        return micro_batches(n, size, self)

    def gather_rows(self, local: torch.Tensor, n: int) -> torch.Tensor:
        """The (n, ...) tensor whose rows each rank holds a share of (`rows(n)`), on every rank."""
        local = local.contiguous()
        base, extra = divmod(n, self.world)
        padded = torch.zeros((base + (extra > 0), *local.shape[1:]), dtype=local.dtype, device=local.device)
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded)
        return torch.cat([part[: base + (r < extra)] for r, part in enumerate(parts)])


def from_env(device: str, nproc: int | None = None) -> Dist | None:
    """The process group this process belongs to, from torchrun's environment (WORLD_SIZE > 1);
    None for a single process. `nproc` > 1 without that environment is an error that says how to
    start the ranks."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        if nproc is not None and nproc > 1:
            raise ValueError(
                f"nproc {nproc} needs {nproc} processes: start the service with `rlhf serve` (it "
                f"starts them) or under torchrun --nproc-per-node {nproc}"
            )
        return None
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    cuda = device == "cuda" or device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world, timeout=DATA_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    log.info("rank %d of %d (%s)", rank, world, "nccl" if cuda else "gloo")
    return Dist(rank, world, local_rank, control, device_type="cuda" if cuda else "cpu")


def micro_batches(n: int, micro: int, d: "Dist | None" = None) -> list[tuple[torch.Tensor, bool]]:
    """The row positions (of a batch of `n`) of each micro-batch of at most `micro` rows this
    process runs, and whether it counts. With N processes each runs its share (`Dist.rows`), and
    every process runs as many micro-batches; one short of rows runs row 0 and counts it not, so
    the processes' collectives pair up."""
    if d is None:
        return [(torch.arange(s, min(s + micro, n)), True) for s in range(0, n, micro)]
    start, end = d.rows(n)
    most = -(-n // d.world)
    out = []
    for s in range(0, most, micro):
        a, b = start + s, min(start + s + micro, end)
        out.append((torch.arange(a, b), True) if b > a else (torch.arange(1), False))
    return out
