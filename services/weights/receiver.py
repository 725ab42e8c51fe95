"""The server's side of a weight push, whatever the transport, in one place: the fence (a
version is taken only from the run's learner, `LearnerFence`), a version received (the gRPC
stream, `apply_chunks`; a file in shared memory, `apply_shared`; a late server's `pull` from the
learner), checked, and swapped into the backend atomically between batches, one update at a time,
each wait bounded by the call's deadline (the waits and the swap itself: swap.py).

The generation server is a thin adapter over `WeightReceiver`: its RPCs call it, and it hands the
receiver its backend, its compute thread (`run(fn, timeout=)`: fn runs between batches; a run that
has not started within `timeout` is withdrawn and raises a TimeoutError) and its readiness."""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterator, NamedTuple

import grpc
import redis

from ..common.replay import ReplayStore
from ..common.rpc.errors import BadRequest, DeadlineExceeded, Unavailable
from ..common.rpc.gen import common_pb2
from ..common.rpc.waits import Counted, wait_failed
from . import delta
from .assemble import assemble_weights
from .check import check_newer
from .protocol import COMPLETE_FORMATS
from .shm import Probe, open_shared_weights
from .swap import Swapper, Waits

if TYPE_CHECKING:
    from ..common.config import Config

log = logging.getLogger(__name__)

Fence = Callable[[common_pb2.WeightHeader], None]


class LearnerFence:
    """The generation server's check of a weight push's (or pull's) header in a distributed run:
    it comes from the run's learner (run_id and epoch as the learner published them in the replay
    registry) and its policy_version is not above the registry's version counter (the learner raises it
    before each push). Anything else is refused with `BadRequest`; a registry that cannot be
    reached gives `Unavailable`."""

    def __init__(self, store: ReplayStore):
        self.store = store

    def __call__(self, header: common_pb2.WeightHeader) -> None:
        try:
            info = self.store.learner_info()
            counter = self.store.version()
        except (redis.RedisError, OSError) as e:
            raise Unavailable(
                f"weights: the replay registry cannot be reached to check the push's writer: {e}"
            ) from None
        writer = f"run_id={header.run_id!r}, epoch={header.epoch}"
        if not info:
            raise BadRequest(
                f"weights: push from a writer that is not the run's learner ({writer}): no learner "
                f"has registered in the replay namespace {self.store.ns!r}"
            )
        run_id, epoch = info.get("run_id", ""), int(info.get("epoch") or 0)
        if header.run_id != run_id or int(header.epoch) != epoch:
            raise BadRequest(
                f"weights: push from a writer that is not the run's learner ({writer}; the learner "
                f"registered in {self.store.ns!r} has run_id={run_id!r}, epoch={epoch})"
            )
        if header.policy_version > counter:
            raise BadRequest(
                f"weights: push from a writer that is not the run's learner: version {header.policy_version} "
                f"is above the run's version counter {counter}"
            )


def shm_probe(shm_dir: str | None) -> Probe | None:
    """A server's probe in `rpc.shm_dir` (None when unset, or when the directory cannot be
    written: then every version comes over the gRPC stream)."""
    if not shm_dir:
        return None
    try:
        return Probe(shm_dir)
    except OSError as e:
        log.warning("rpc.shm_dir %s cannot be used (%s): weights will come over gRPC only", shm_dir, e)
        return None


class Applied(NamedTuple):
    """A version applied: its number, bytes, seconds in all, and of those the seconds the swap
    waited for the running batch (its end, or its next step in flight) and the swap's own."""

    policy_version: int
    nbytes: int
    seconds: float
    swap_wait_s: float = 0.0
    swap_s: float = 0.0


class WeightReceiver:
    """`fence(header)`, when given, decides whether a version comes from the run's writer: it
    raises `BadRequest` (refused) or `Unavailable` (cannot tell); it runs as soon as the header
    arrives and again right before the swap. Without it, any version newer than the serving one
    is applied. `probe` is the server's proof of its shared-memory directory (`apply_shared` reads
    from there). `base` says where the weights outside a partial version come from: the model it
    loaded ("model:<model.path>") until a full version from a run replaces them ("run:<run_id>").

    With `rpc.delta_push`, the receiver keeps the last version it applied from the stream (full
    or delta) as its delta base: the tensors it assembled, a copy of the model in host memory
    (`delta_base`; none after a restart, a partial version or one from shared memory). A server
    advertises it (`delta_base_key`), and the learner sends it only what changed since."""

    def __init__(
        self,
        backend,
        run: Callable,
        cfg: Config,
        fence: Fence | None = None,
        probe: Probe | None = None,
        readiness=None,
        on_applied: Callable[[Applied], None] | None = None,
    ):
        self.backend, self.run, self.cfg, self.fence, self.probe = backend, run, cfg, fence, probe
        self.readiness = readiness  # the RPC server (set_ready, liveness), or None
        self.swapper = Swapper(run, readiness, backend)  # the swap, between batches on `run`
        self.on_applied = on_applied  # told of each version applied (the server's metrics)
        self.base = f"model:{cfg.model.path}"
        self.lock = threading.Lock()  # one update at a time
        self.keeps_delta_base = cfg.rpc.delta_push
        if self.keeps_delta_base and not delta.available():
            log.warning("rpc.delta_push is on but the zstandard package is missing: every version comes whole")
            self.keeps_delta_base = False
        self.delta_base: delta.Base | None = None

    def held_base(self) -> delta.Base | None:
        """The delta base, while it is the version the backend serves (anything that updated
        the backend another way leaves it behind)."""
        b = self.delta_base
        return b if b is not None and b.policy_version == self.backend.policy_version else None

    def delta_base_key(self) -> str:
        """What the registry entry's `delta_base` says: the version a delta may be against, or ""."""
        b = self.held_base()
        return b.key if b is not None else ""

    def max_bytes(self) -> int:
        return self.cfg.rpc.max_message_mb * 1024 * 1024 * 64

    def apply_chunks(self, chunks, context=None, origin: str = "") -> Applied:
        """Assemble a header/pieces/footer stream and apply it as one new policy version (a push,
        or a late server's pull). Its waits end with the call's deadline (`context`; without one,
        rpc.timeout_s)."""
        return self._apply(
            lambda: contextlib.nullcontext(
                assemble_weights(
                    chunks,
                    self.backend.parameter_specs(),
                    self.max_bytes(),
                    on_header=self.fence,
                    base=self.held_base(),
                )
            ),
            context=context,
            origin=origin,
            owned=True,
        )

    def apply_shared(self, request, context=None) -> Applied:
        """Check and apply a version the co-located learner wrote into shared memory."""
        if self.probe is None:
            raise BadRequest("shm: this server has no shared-memory directory (rpc.shm_dir)")
        check_newer(request.header.policy_version, self.backend.policy_version)  # before reading anything
        return self._apply(
            lambda: open_shared_weights(
                str(self.probe.dir),
                request,
                self.backend.parameter_specs(),
                self.max_bytes(),
                self.fence,
                self.probe.mappings,
            ),
            "shared memory",
            context=context,
        )

    def pull(self, open_stream: Callable[[], Iterator], origin: str, timeout: float, wanted) -> bool:
        """Pull version `wanted` from the learner at `origin` (`open_stream()`: its PullWeights
        stream, whose deadline is `timeout`) and apply it; True if it was applied. A stream that
        fails, or an apply whose wait passes, is logged with its phase and the learner's address;
        a version the fence refuses, or one a push applied first, is skipped."""
        t0 = time.monotonic()
        stream = Counted(())
        try:
            stream = Counted(open_stream())
            first = next(stream, None)
            if first is None:
                return False
            policy_version, nbytes, secs, _, _ = self.apply_chunks(itertools.chain([first], stream), origin=origin)
            log.info(
                "pulled policy version %d from the learner at %s (%.1f MB, %.2fs)",
                policy_version,
                origin,
                nbytes / 1e6,
                secs,
            )
            return True
        except DeadlineExceeded:  # the apply's wait (logged with its phase where it passed)
            return False
        except BadRequest as e:  # a push of the same version won the race, or the fence refused it
            log.info("pull skipped: %s", e)
            return False
        except grpc.RpcError as e:
            log.warning(
                "%s (it pulls again when it finds itself behind)",
                wait_failed(
                    f"weight pull v{wanted} from the learner at",
                    origin,
                    stream.phase("stream", "apply"),
                    e,
                    time.monotonic() - t0,
                    timeout,
                ),
            )
            return False

    def _apply(self, source, via: str = "stream", context=None, origin: str = "", owned: bool = False) -> Applied:
        """One update at a time (`owned`: the source's tensors are this receiver's to keep, as a
        delta base). Each wait ends with the call's deadline (`Waits`), naming its
        phase and the peer: for an earlier update to finish ('wait-for-previous-update'), the
        stream itself (gRPC ends it at the deadline), for the running batch before the swap
        ('swap'; a swap that has not started by then is withdrawn, nothing changes)."""
        t0 = time.perf_counter()
        waits = Waits(context, self.cfg.rpc.timeout_s, origin)
        if not self.lock.acquire(timeout=waits.budget):
            raise waits.passed(
                f"weight update ({via}) from",
                "wait-for-previous-update",
                "another weight update held this server for the whole deadline",
            )
        try:
            with source() as (policy_version, fmt, state, nbytes, header):
                wait_s, swap_s = self.swapper.swap(
                    functools.partial(self._swap, policy_version, fmt, state, header, owned),
                    state,
                    waits,
                    f"weight update v{policy_version} ({via}) from",
                )
        except grpc.RpcError:  # reading the pushed stream: gRPC ended the call (its deadline, a cancel)
            if context is not None and not context.is_active():
                raise waits.passed(
                    f"weight update ({via}) from", "stream", "the call ended before the whole stream came"
                ) from None
            raise
        finally:
            self.lock.release()
        secs = time.perf_counter() - t0
        return self._applied(Applied(policy_version, nbytes, secs, wait_s, swap_s), fmt, via)

    def _swap(self, policy_version: int, fmt: str, state: dict, header, owned: bool) -> None:
        """On the compute thread, between batches (or decoding steps): the fence again (another
        learner may have taken over while the pieces came), the backend's update, then where the
        weights come from and the delta base."""
        if self.fence is not None:
            self.fence(header)
        self.backend.update_weights(state, policy_version)
        if fmt in COMPLETE_FORMATS:
            self.base = f"run:{header.run_id}"
        keep = self.keeps_delta_base and owned and fmt in COMPLETE_FORMATS
        self.delta_base = delta.Base(header.run_id, header.epoch, policy_version, dict(state)) if keep else None

    def _applied(self, a: Applied, fmt: str, via: str) -> Applied:
        log.info(
            "policy version %d applied (%s, %.1f MB in %.2fs, %s; %.2fs waiting for the batch, %.2fs swapping)",
            a.policy_version,
            fmt,
            a.nbytes / 1e6,
            a.seconds,
            via,
            a.swap_wait_s,
            a.swap_s,
        )
        if self.on_applied is not None:
            self.on_applied(a)
        return a
