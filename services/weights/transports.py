"""The two transports of a weight push (publisher.py says which server gets which), strategies
with one interface (`jobs`: one callable per server, each ending in a `Delivery`; `finish`):
`SharedMemoryTransport` (one file in `rpc.shm_dir`, loaded by every co-located server) and
`StreamTransport` (the gRPC stream, encoded once per payload and read by all its servers,
`stream.Fanout`); and what both share, how they reach the servers and report (`Reach`).
"""

from __future__ import annotations

import enum
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import grpc

from ..common.rpc.errors import Reason, reason_of
from ..common.rpc.waits import Counted, wait_failed
from ..common.types import Progress, no_progress
from . import shm
from .protocol import PushKind, chunk_bytes
from .shm_writer import SharedWeightsWriter
from .stream import Fanout, StreamSpec, encode_weights

if TYPE_CHECKING:
    from ..common.config import Config

Job = Callable[[], "Delivery"]  # one server's push, run on the publisher's pool

log = logging.getLogger("services.weights.publisher")  # its lines read as the publisher's, as before

PUSH_WINDOW_BYTES = 128 << 20  # encoded chunks held for the slowest server
UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class Delivery(enum.Enum):
    """What became of one server's push, whichever transport carried it."""

    TOOK = "took"  # the server serves the version: register it
    HELD = "held"  # it refused the version as not newer: it pulled it (or a newer one) itself
    FAILED = "failed"  # unreachable, or its deadline passed: it pulls when it sees it is behind
    STREAM_INSTEAD = "stream"  # shared memory: the server refused the load; stream it over gRPC in this push
    FULL_INSTEAD = "full"  # a delta: the server holds no such base; stream it the full version in this push


def _newer_already(e: grpc.RpcError) -> bool:
    """The server refused the version as not newer: it pulled it itself a moment ago."""
    return reason_of(e) is Reason.VERSION_NOT_NEWER


def _no_base(e: grpc.RpcError) -> bool:
    """The server refused a delta: it does not hold the version the delta is against."""
    return reason_of(e) is Reason.DELTA_BASE_MISSING


@dataclass
class Reach:
    """How the transports reach the servers and report, shared by them (not the publisher
    itself): `client(address)` (`push_encoded(chunks)`, `load_shared(request)`, `timeout`),
    `on_progress()` as each server answers, `identity` (run id, epoch) the fence every version
    carries, and `tell` (a log line once per key)."""

    cfg: Config
    client: Callable
    on_progress: Progress = no_progress
    identity: tuple[str, int] = ("", 0)
    told: set = field(default_factory=set)

    def tell(self, key, msg: str, *args, level=logging.INFO) -> None:
        """Log `msg` once per `key` (a server's fallback, a plan's reason)."""
        if key not in self.told:
            self.told.add(key)
            log.log(level, msg, *args)


class StreamTransport:
    """The gRPC stream: one encoding of a payload read by every server of the targets."""

    name = "grpc"

    def __init__(self, reach: Reach):
        self.reach = reach
        self._fans: list[Fanout] = []
        self.encoded: dict[PushKind, int] = {}  # payload kind -> bytes of its one encoding (read by all its servers)

    def chunk_bytes(self) -> int:
        return chunk_bytes(self.reach.cfg.rpc.max_message_mb)

    def jobs(
        self, targets: list[str], state: dict, kind: PushKind, policy_version: int, base: tuple[int, dict] | None = None
    ) -> dict[str, Job]:
        """Stream `state` to every address of `targets`: {address: its job}; the jobs run at once
        (the encoding waits for its slowest reader). A DELTA: as changes to `base`, (its
        policy_version, its state)."""
        run_id, epoch = self.reach.identity
        chunk = self.chunk_bytes()
        base_version, base_state = base if base is not None else (0, None)
        fan = Fanout(
            self._counted(
                encode_weights(state, StreamSpec(policy_version, chunk, kind, run_id, epoch, base_state, base_version)),
                kind,
            ),
            len(targets),
            window=max(2, PUSH_WINDOW_BYTES // chunk),
        )
        self._fans.append(fan)

        def one(i: int, address: str) -> Delivery:
            try:
                return self._push_one(address, fan.reader(i), policy_version)
            finally:
                fan.detach(i)  # a failed stream no longer holds the others back

        return {a: functools.partial(one, i, a) for i, a in enumerate(targets)}

    def _counted(self, chunks, kind: PushKind):
        self.encoded.setdefault(kind, 0)
        try:
            for chunk in chunks:
                self.encoded[kind] += len(chunk)
                yield chunk
        finally:
            chunks.close()  # a stream nobody reads any more stops encoding (a delta's threads with it)

    def _push_one(self, address: str, chunks, policy_version: int) -> Delivery:
        """Push one server the (already encoded) stream `chunks`."""
        sent, t0 = Counted(chunks), time.monotonic()
        client = self.reach.client(address)
        try:
            client.push_encoded(sent)
        except grpc.RpcError as e:
            if _newer_already(e):
                return Delivery.HELD
            if _no_base(e):
                self.reach.tell(
                    (address, "no-delta-base", policy_version),
                    "%s holds no base for the delta of version %d (%s); streaming it the full version",
                    address,
                    policy_version,
                    e.details(),
                )
                return Delivery.FULL_INSTEAD
            # all chunks out: the deadline passed while the server checked or swapped them in
            log.warning(
                "%s (it will pull when it sees it is behind)",
                wait_failed(
                    f"weight push v{policy_version} to",
                    address,
                    sent.phase("stream", "apply"),
                    e,
                    time.monotonic() - t0,
                    client.timeout,
                ),
            )
            return Delivery.FAILED
        finally:
            self.reach.on_progress()
        return Delivery.TOOK

    def finish(self) -> None:
        for fan in self._fans:
            fan.join()
        self._fans.clear()

    def take_encoded(self) -> dict[PushKind, int]:
        """Bytes encoded per payload kind since the last call (after `finish`)."""
        out, self.encoded = self.encoded, {}
        return out


class SharedMemoryTransport:
    """One file in `rpc.shm_dir` per payload, loaded by every co-located server of the targets."""

    name = "shm"

    def __init__(self, reach: Reach):
        self.reach = reach
        self.writer: SharedWeightsWriter | None = None

    def colocated(self, info: dict) -> bool:
        return shm.colocated(self.reach.cfg.rpc.shm_dir, info.get("shm"))

    def _write(self, state: dict, policy_version: int, kind: PushKind):
        """The version written into shared memory (the request that points a server at it); None
        when it cannot be written (then its servers get the stream)."""
        run_id, epoch = self.reach.identity
        shm_dir = self.reach.cfg.rpc.shm_dir
        if shm_dir is None:  # no server is co-located without one
            return None
        try:
            if self.writer is None or self.writer.run_id != run_id:
                self.writer = SharedWeightsWriter(shm_dir, run_id)
                self.writer.cleanup()  # what an earlier learner process of this run left
            return self.writer.write(state, policy_version, epoch, kind)
        except (OSError, TypeError) as e:
            self.reach.tell(
                ("shm-write", type(e)),
                "cannot write version %d into rpc.shm_dir %s (%s); streaming over gRPC",
                policy_version,
                self.reach.cfg.rpc.shm_dir,
                e,
                level=logging.WARNING,
            )
            return None

    def jobs(self, targets: list[str], state: dict, kind: PushKind, policy_version: int) -> dict[str, Job] | None:
        """{address: its job}; None when the file cannot be written."""
        request = self._write(state, policy_version, kind)
        if request is None:
            return None
        return {a: functools.partial(self._load_one, a, request, policy_version) for a in targets}

    def _load_one(self, address: str, request, policy_version: int) -> Delivery:
        """Point one co-located server at the shared file."""
        t0 = time.monotonic()
        client = self.reach.client(address)
        try:
            client.load_shared(request)
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
            if _newer_already(e):
                return Delivery.HELD
            if code in UNREACHABLE:
                log.warning(
                    "%s (it will pull when it sees it is behind)",
                    wait_failed(
                        f"weight push v{policy_version} to",
                        address,
                        "shm-load",
                        e,
                        time.monotonic() - t0,
                        client.timeout,
                    ),
                )
                return Delivery.FAILED
            self.reach.tell(
                (address, "stream"),
                "shared-memory load of version %d refused by %s (%s: %s); streaming over gRPC instead",
                policy_version,
                address,
                code.name,
                details,
                level=logging.WARNING,
            )
            return Delivery.STREAM_INSTEAD
        finally:
            self.reach.on_progress()
        return Delivery.TOOK

    def close(self) -> None:
        if self.writer is not None:
            self.writer.cleanup()
