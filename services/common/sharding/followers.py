"""Rank 0 and its followers: ranks 1..N-1 started by rank 0 (or torchrun), running the calls rank 0
announces (`collective` methods) until it releases them; a broken group exits so that it is restarted whole."""

from __future__ import annotations

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

import torch.distributed as dist

from .group import Dist

log = logging.getLogger(__name__)


def collective(method):
    """A `ShardedPolicyTrainer` or `ShardedCritic` method every rank must run together: rank 0
    announces it (its arguments with it) before running it; followers run what they receive
    (`follow`). Arguments named in `LOCAL_KWARGS` stay on rank 0 (the critic client)."""
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
                log.critical(
                    "%s: a process of the group is gone (%s); exiting so that the whole group is "
                    "restarted (it resumes from the newest checkpoint)",
                    method.__name__,
                    e,
                )
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
    return isinstance(e, RuntimeError) and any(
        s in text for s in ("gloo", "NCCL", "Connection closed by peer", "Connection reset by peer")
    )


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
    common = {
        "WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "LOCAL_WORLD_SIZE": str(nproc),
    }
    os.environ.update({**common, "RANK": "0", "LOCAL_RANK": "0"})
    procs = []
    for rank in range(1, nproc):
        env = {**os.environ, **common, "RANK": str(rank), "LOCAL_RANK": str(rank), "RLHF_FOLLOWER": "1"}
        procs.append(
            subprocess.Popen([sys.executable, "-m", "services.cli", *argv], env=env, preexec_fn=_die_with_parent)
        )
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
                log.critical(
                    "follower rank (pid %d) exited with code %s; exiting so that the whole group is "
                    "restarted (it resumes from the newest checkpoint)",
                    p.pid,
                    p.returncode,
                )
                logging.shutdown()
                os._exit(EXIT_GROUP_BROKEN)
        _released.wait(0.5)


def ignore_stop_signals() -> None:
    """A follower: rank 0 decides when the group stops."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
