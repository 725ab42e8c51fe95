"""A model trained across N processes (GPUs), sharded with FSDP2: the learner's actor and
reference (services/learner/sharded.py), and the critic server's value model (services/critic/sharded.py).

    rlhf serve learner -c FILE --nproc 2      (or model.nproc: 2; or torchrun --nproc-per-node 2)
    rlhf serve critic -c FILE --nproc 2       (or critic.nproc: 2)

For the learner, rank 0 is the learner service: it reads the replay buffer, owns the ledger, pushes weights,
evaluates and serves gRPC. Ranks 1..N-1 are followers: they hold their shards of the model and
of the optimiser state, and run the calls rank 0 announces (`collective` methods of
`ShardedPolicyTrainer`: a step on a batch, a full state dict for a push, a sharded save or load) on a
control channel (a gloo group that waits as long as rank 0 waits for data). Each rank computes
its share of every batch's rows; FSDP2 averages the gradients, so an update equals the
single-process one on the same batch.

`rlhf serve learner --nproc N` starts the followers itself (each dies with rank 0: a crashed
learner takes its followers down, and the supervisor restarts the whole group); under torchrun
(multi-node) the usual RANK / WORLD_SIZE / MASTER_ADDR environment is used instead. CPU runs use
the gloo backend, GPU runs NCCL with one GPU per process (LOCAL_RANK).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import inspect
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

CONTROL_TIMEOUT = timedelta(days=30)  # followers wait on the control channel as long as rank 0 waits for data
# the collectives of a step, a push or a checkpoint: followers may wait in one while rank 0 waits
# for its critic server (rpc.dependency_wait_s); a dead process is noticed by the watchdog
# (`start_followers`) or by the backend, not by this timeout
DATA_TIMEOUT = timedelta(hours=2)


@dataclass
class Dist:
    rank: int
    world: int
    local_rank: int
    control: object  # the gloo process group of the control channel and the metric reductions
    device_type: str = "cpu"
    _mesh: object = None

    def mesh(self):
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
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def all_sum(self, values: list[float]) -> list[float]:
        """Element-wise sums over the ranks (on the control group: CPU tensors on any backend)."""
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=self.control)
        return t.tolist()

    def local_rows(self, n: int) -> tuple[torch.Tensor, int]:
        """The row indices this rank runs of a batch of `n`, and how many of them count: a rank
        with no share (n < N) runs row 0 and counts none, so every rank runs the same collectives."""
        start, end = self.rows(n)
        return (torch.arange(start, end), end - start) if end > start else (torch.arange(1), 0)

    def rows(self, n: int) -> tuple[int, int]:
        """This rank's [start, end) of `n` rows split as evenly as possible (earlier ranks take
        one more when it does not divide)."""
        base, extra = divmod(n, self.world)
        start = self.rank * base + min(self.rank, extra)
        return start, start + base + (self.rank < extra)

    def gather_rows(self, local: torch.Tensor, n: int) -> torch.Tensor:
        """The (n, ...) tensor whose rows each rank holds a share of (`rows(n)`), on every rank."""
        base, extra = divmod(n, self.world)
        padded = torch.zeros((base + (extra > 0), *local.shape[1:]), dtype=local.dtype, device=local.device)
        padded[:local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded)
        return torch.cat([part[:base + (r < extra)] for r, part in enumerate(parts)])


def from_env(device: str, nproc: int | None = None) -> Dist | None:
    """The process group this process belongs to, from torchrun's environment (WORLD_SIZE > 1);
    None for a single process. `nproc` > 1 without that environment is an error that says how to
    start the ranks."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        if nproc is not None and nproc > 1:
            raise ValueError(f"nproc {nproc} needs {nproc} processes: start the service with `rlhf serve` (it "
                             f"starts them) or under torchrun --nproc-per-node {nproc}")
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


def collective(method):
    """A `ShardedPolicyTrainer` or `ShardedCritic` method every rank must run together: rank 0
    announces it (its arguments with it) before running it; followers run what they receive
    (`follow`). Arguments named in `local_kwargs` stay on rank 0 (the critic client)."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        d = self.dist
        if d is None or not d.main:
            return method(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs).arguments
        shared = {k: v for k, v in list(bound.items())[1:] if k not in LOCAL_KWARGS}
        try:
            d.announce(method.__name__, shared)
            return method(self, *args, **kwargs)
        except Exception as e:
            if group_broken(e):
                log.critical("%s: a process of the group is gone (%s); exiting so that the whole group is "
                             "restarted (it resumes from the newest checkpoint)", method.__name__, e)
                logging.shutdown()
                os._exit(EXIT_GROUP_BROKEN)
            raise
    return wrapper


EXIT_GROUP_BROKEN = 75


def group_broken(e: BaseException) -> bool:
    """Whether `e` says a peer process of the group died or hung (its collectives cannot go on)."""
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(s in text for s in ("gloo", "NCCL", "Connection closed by peer",
                                                                   "Connection reset by peer"))


LOCAL_KWARGS = ("critic", "tokenizer")
STOP = "__stop__"


def follow(owner) -> int:
    """A follower's life: run every call rank 0 announces on `owner` (a learner or a critic) until
    it says stop. A call that fails here fails on rank 0 too (the same checks on the same data:
    a checkpoint that cannot be loaded, a refused step); rank 0 reports it, the follower goes on."""
    d = owner.dist
    while True:
        name, kwargs = d.receive()
        if name == STOP:
            log.info("rank %d: rank 0 is done", d.rank)
            _leave(d)
            return 0
        try:
            getattr(owner, name)(**kwargs)
        except (ValueError, KeyError, OSError, ArithmeticError) as e:  # checks every rank makes alike
            log.info("rank %d: %s failed as on rank 0: %s", d.rank, name, e)


def release_followers(owner, timeout_s: float = 10.0) -> None:
    """Rank 0: tell the followers the run is over (they exit 0). A follower stuck elsewhere (rank
    0 failed inside a collective) is not waited for: it dies with rank 0's process."""
    d = getattr(owner, "dist", None)
    if d is None or not d.main:
        return
    owner.dist = None  # once
    _released.set()  # the followers' exits that follow are expected
    def release():
        d.announce(STOP)
        _leave(d)
    t = threading.Thread(target=release, daemon=True, name="release-followers")
    t.start()
    t.join(timeout_s)


def _leave(d: Dist) -> None:
    """Every rank leaves the group together (a barrier, then the process groups are destroyed), so
    no rank tears its connections down while another still uses them."""
    dist.barrier(group=d.control)
    dist.destroy_process_group()


# ---------------------------------------------------------------------- sharding and state
def shard(model: torch.nn.Module, mesh=None) -> torch.nn.Module:
    """FSDP2: every block transformers says not to split (`_no_split_modules` of the model or of a
    backbone inside it: the decoder layers) is a unit of its own, then the root (embeddings, final
    norm, heads). Parameters on the CPU move to the mesh's device shard by shard."""
    from torch.distributed.fsdp import fully_shard
    names = {n for m in model.modules() for n in (getattr(m, "_no_split_modules", None) or [])}
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        log.warning("%s names no blocks to shard (_no_split_modules): the whole model is one FSDP unit, "
                    "gathered whole in every forward", type(model).__name__)
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


def full_state_dict(model: torch.nn.Module, pinned: bool = False) -> dict[str, torch.Tensor]:
    """The whole model's weights on the CPU, on rank 0 (other ranks get {}); collective. With
    `pinned` (a push), GPU tensors come to the host through page-locked memory (`hostcopy`), one
    gathered tensor at a time, as torch's own gather does into pageable memory (4-5x slower)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    if not pinned:
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    from torch.distributed.tensor import DTensor
    from ..weights.hostcopy import to_host
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
    state = {"model": msd, "optim": osd}
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
    osd = {"state": {names[int(i)]: s for i, s in saved["state"].items()},
           "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in saved["param_groups"]]}
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
    set_optimizer_state_dict(model, optimizer, osd, options=StateDictOptions(full_state_dict=True))


# ---------------------------------------------------------------------- launching
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # preexec_fn: SIGKILL when rank 0's process is gone (Linux)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def start_followers(nproc: int, argv: list[str]) -> list[subprocess.Popen]:
    """Make this process rank 0 of `nproc` and start ranks 1..nproc-1 running `rlhf` with the same
    arguments. They ignore SIGINT/SIGTERM (rank 0 drains, checkpoints with them, then releases
    them) and die with this process."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return []  # under torchrun: the ranks exist already
    port = free_port()
    common = {"WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
              "LOCAL_WORLD_SIZE": str(nproc)}
    os.environ.update({**common, "RANK": "0", "LOCAL_RANK": "0"})
    procs = []
    for rank in range(1, nproc):
        env = {**os.environ, **common, "RANK": str(rank), "LOCAL_RANK": str(rank), "RLHF_FOLLOWER": "1"}
        procs.append(subprocess.Popen([sys.executable, "-m", "services.cli", *argv], env=env,
                                      preexec_fn=_die_with_parent))
    log.info("started %d follower rank(s) (pids %s)", len(procs), [p.pid for p in procs])
    threading.Thread(target=_watch_followers, args=(procs,), daemon=True, name="followers-watchdog").start()
    return procs


_released = threading.Event()


def _watch_followers(procs: list[subprocess.Popen]) -> None:
    """Rank 0: a follower that exits before rank 0 releases it leaves the group broken (rank 0
    would wait in its next collective): exit 75 at once, so the supervisor restarts the group."""
    while not _released.is_set():
        for p in procs:
            if p.poll() is not None and not _released.is_set():
                log.critical("follower rank (pid %d) exited with code %s; exiting so that the whole group is "
                             "restarted (it resumes from the newest checkpoint)", p.pid, p.returncode)
                logging.shutdown()
                os._exit(EXIT_GROUP_BROKEN)
        _released.wait(0.5)


def ignore_stop_signals() -> None:
    """A follower: rank 0 decides when the group stops."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
