"""The learner's side of a weight push: one version delivered to many servers at once, each by the
transport its plan names, the transports being strategies with one interface (`start`: a future
per server of the targets; `finish`):
- `StreamTransport`: the gRPC stream, encoded once per payload and read by all its servers
  (`stream.Fanout`);
- `SharedMemoryTransport`: one file in `rpc.shm_dir` for every server proven to share the
  directory (`shm.colocated`), each told where it is by a `SharedWeights` request. A load a
  server refuses (other than by being unreachable) is streamed to it in the same push; a file
  that cannot be written sends its servers the stream.

What a push sends (the snapshot, full or partial, the plan per server) is the learner's
(`learner/broadcast.py`); this module moves bytes. A server is reached through `client(address)`
(`push_encoded(chunks)`, `load_shared(request)`, `timeout`), and `registered(address, info,
version, kind)` runs once a server took a version. Each server's push ends as a `Delivery`.

One weight push, hop by hop (docs/architecture.md, section 12):
    learner/loop.py:PushSink.publish            the version, from Redis's counter (common/replay/fence.py)
    learner/broadcast.py:WeightBroadcaster.push snapshot; plan each server; the live ones from ServerPool
    Publisher.deliver                           every server at once, by its transport (this file)
    generation/server.py:PushWeights, LoadSharedWeights
      weights/receiver.py:WeightReceiver        fence, assemble and check, swap between batches
    learner/broadcast.py:_registered            the registry shows the version to the workers
"""

from __future__ import annotations

import enum
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import grpc

from ..common.rpc.errors import Reason, reason_of
from ..common.rpc.waits import Counted, wait_failed
from ..common.types import Progress, no_progress
from . import shm
from .protocol import chunk_bytes
from .stream import Fanout, encode_weights

if TYPE_CHECKING:
    from ..common.config import Config

log = logging.getLogger(__name__)

PUSH_WINDOW_BYTES = 128 << 20  # encoded chunks held for the slowest server
UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class Delivery(enum.Enum):
    """What became of one server's push, whichever transport carried it."""

    TOOK = "took"  # the server serves the version (or a newer one already)
    FAILED = "failed"  # unreachable, or its deadline passed: it pulls when it sees it is behind
    STREAM_INSTEAD = "stream"  # shared memory: the server refused the load; stream it over gRPC in this push


def _newer_already(e: grpc.RpcError) -> bool:
    """The server refused the version as not newer: it pulled it itself a moment ago."""
    return reason_of(e) is Reason.VERSION_NOT_NEWER


@dataclass
class Reach:
    """How the transports reach the servers and report, shared by them (not the publisher
    itself): `client(address)`, `registered(address, info, version, kind)` once a server took a
    version, `on_progress()` as each server answers, `identity` (run id, epoch) the fence every
    version carries, and `tell` (a log line once per key)."""

    cfg: Config
    client: Callable
    registered: Callable[[str, dict, int, str], None]
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

    def chunk_bytes(self) -> int:
        return chunk_bytes(self.reach.cfg.rpc.max_message_mb)

    def start(self, pool, targets: list, state: dict, kind: str, version: int) -> dict:
        """Stream `state` to every (address, info) of `targets`: {address: future of a `Delivery`}."""
        run_id, epoch = self.reach.identity
        chunk = self.chunk_bytes()
        fan = Fanout(
            encode_weights(state, version, chunk, fmt=kind, run_id=run_id, epoch=epoch),
            len(targets),
            window=max(2, PUSH_WINDOW_BYTES // chunk),
        )
        self._fans.append(fan)

        def one(i, address, info):
            try:
                return self._push_one(address, fan.reader(i), version, info, kind)
            finally:
                fan.detach(i)  # a failed stream no longer holds the others back

        return {a: pool.submit(one, i, a, info) for i, (a, info) in enumerate(targets)}

    def _push_one(self, address: str, chunks, version: int, info: dict, kind: str) -> Delivery:
        """Push one server the (already encoded) stream `chunks`."""
        sent, t0 = Counted(chunks), time.monotonic()
        client = self.reach.client(address)
        try:
            client.push_encoded(sent)
        except grpc.RpcError as e:
            if _newer_already(e):
                return Delivery.TOOK
            # all chunks out: the deadline passed while the server checked or swapped them in
            log.warning(
                "%s (it will pull when it sees it is behind)",
                wait_failed(
                    f"weight push v{version} to",
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
        self.reach.registered(address, info, version, kind)
        return Delivery.TOOK

    def finish(self) -> None:
        for fan in self._fans:
            fan.join()
        self._fans.clear()


class SharedMemoryTransport:
    """One file in `rpc.shm_dir` per payload, loaded by every co-located server of the targets."""

    name = "shm"

    def __init__(self, reach: Reach):
        self.reach = reach
        self.writer: shm.SharedWeightsWriter | None = None

    def colocated(self, info: dict) -> bool:
        return shm.colocated(self.reach.cfg.rpc.shm_dir, info.get("shm"))

    def _write(self, state: dict, version: int, kind: str):
        """The version written into shared memory (the request that points a server at it); None
        when it cannot be written (then its servers get the stream)."""
        run_id, epoch = self.reach.identity
        shm_dir = self.reach.cfg.rpc.shm_dir
        if shm_dir is None:  # no server is co-located without one
            return None
        try:
            if self.writer is None or self.writer.run_id != run_id:
                self.writer = shm.SharedWeightsWriter(shm_dir, run_id)
                self.writer.cleanup()  # what an earlier learner process of this run left
            return self.writer.write(state, version, epoch, kind)
        except (OSError, TypeError) as e:
            self.reach.tell(
                ("shm-write", type(e)),
                "cannot write version %d into rpc.shm_dir %s (%s); streaming over gRPC",
                version,
                self.reach.cfg.rpc.shm_dir,
                e,
                level=logging.WARNING,
            )
            return None

    def start(self, pool, targets: list, state: dict, kind: str, version: int) -> dict | None:
        """{address: future of a `Delivery`}; None when the file cannot be written."""
        request = self._write(state, version, kind)
        if request is None:
            return None
        return {a: pool.submit(self._load_one, a, request, version, info, kind) for a, info in targets}

    def _load_one(self, address: str, request, version: int, info: dict, kind: str) -> Delivery:
        """Point one co-located server at the shared file."""
        t0 = time.monotonic()
        client = self.reach.client(address)
        try:
            client.load_shared(request)
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
            if _newer_already(e):
                return Delivery.TOOK
            if code in UNREACHABLE:
                log.warning(
                    "%s (it will pull when it sees it is behind)",
                    wait_failed(
                        f"weight push v{version} to", address, "shm-load", e, time.monotonic() - t0, client.timeout
                    ),
                )
                return Delivery.FAILED
            self.reach.tell(
                (address, "stream"),
                "shared-memory load of version %d refused by %s (%s: %s); streaming over gRPC instead",
                version,
                address,
                code.name,
                details,
                level=logging.WARNING,
            )
            return Delivery.STREAM_INSTEAD
        finally:
            self.reach.on_progress()
        self.reach.registered(address, info, version, kind)
        return Delivery.TOOK

    def close(self) -> None:
        if self.writer is not None:
            self.writer.cleanup()


class Publisher:
    """Delivers versions: `via(info)` says which transport reaches a server, `deliver` sends a
    version to every planned server at once. `identity` (run id, epoch) is the fence every
    version carries; `on_progress` runs as each server answers (the learner's heartbeat)."""

    def __init__(
        self,
        cfg: Config,
        client: Callable,
        registered: Callable[[str, dict, int, str], None],
        on_progress: Progress = no_progress,
    ):
        self.reach = Reach(cfg, client, registered, on_progress)  # what both transports use
        self.stream = StreamTransport(self.reach)
        self.shared = SharedMemoryTransport(self.reach)

    @property
    def identity(self) -> tuple[str, int]:
        return self.reach.identity

    @identity.setter
    def identity(self, value: tuple[str, int]) -> None:
        self.reach.identity = value

    def tell(self, key, msg: str, *args, level=logging.INFO) -> None:
        self.reach.tell(key, msg, *args, level=level)

    def via(self, info: dict) -> str:
        """The transport that reaches a server with registry entry `info`: "shm" or "grpc"."""
        return self.shared.name if self.shared.colocated(info) else self.stream.name

    def deliver(self, servers: dict, plan: dict, payloads: dict, version: int) -> dict[str, tuple[Delivery, str]]:
        """Every server's push as `plan` says ({address: (kind, via)}): {address: (what became of it,
        the transport that carried it: "shm" | "grpc")}."""
        groups: dict[tuple[str, str], list] = {}
        for a, (kind, via) in plan.items():
            groups.setdefault((kind, via), []).append((a, servers[a]))
        ok: dict[str, tuple[Delivery, str]] = {}
        # every server's stream or load runs at once (a Fanout needs all its readers reading)
        try:
            with ThreadPoolExecutor(max_workers=max(1, 2 * len(servers))) as pool:
                futures = {}
                for (kind, via), targets in groups.items():
                    if via == self.stream.name:
                        futures.update(self.stream.start(pool, targets, payloads[kind], kind, version))
                shared: set = set()
                for (kind, via), targets in groups.items():
                    if via == self.shared.name:
                        loads = self.shared.start(pool, targets, payloads[kind], kind, version)
                        if loads is None:
                            futures.update(self.stream.start(pool, targets, payloads[kind], kind, version))
                        else:
                            shared.update(loads)
                            futures.update(loads)
                retry: dict[str, list] = {}
                for a, f in futures.items():
                    result = f.result()
                    if result is Delivery.STREAM_INSTEAD:
                        retry.setdefault(plan[a][0], []).append((a, servers[a]))
                    ok[a] = (result, self.shared.name if a in shared else self.stream.name)
                for kind, targets in retry.items():
                    streams = self.stream.start(pool, targets, payloads[kind], kind, version)
                    ok.update({a: (f.result(), self.stream.name) for a, f in streams.items()})
        finally:
            self.stream.finish()
        return ok

    def close(self) -> None:
        self.shared.close()
