"""The learner's side of a weight push, in one place: `Publisher.push` snapshots the new policy,
plans each live server's push, delivers it to every server at once, registers each server that
took it, and publishes the version.

Each push is planned per server, from its registry entry:
- what: the full policy, or with LoRA only the merged target modules ("partial", what training
  changes) when the server's other tensors are provably this run's base: it loaded `model.path`
  (the base) and has had only partial versions since, or it holds a full version of this run; and
  its backend takes partial versions (vLLM's does not: it gets full ones); with `rpc.delta_push`,
  a "delta" (what changed since the previous version, `delta.py`) to a server over the stream
  whose entry says it holds that version (`delta_base`); one that turns out not to hold it
  (`Reason.DELTA_BASE_MISSING`) is streamed the full version in the same push;
- how: by one of two transports (transports.py), strategies with one interface (`jobs`: one
  callable per server, each ending in a `Delivery`; `finish`), all servers at once (deliver.py):
  - `SharedMemoryTransport`: one file in `rpc.shm_dir` for every server proven to share the
    directory (`shm.colocated`: its probe file), each told where it is by a `SharedWeights`
    request. A load a server refuses (other than by being unreachable) is streamed to it in the
    same push; a file that cannot be written sends its servers the stream.
  - `StreamTransport`: the gRPC stream, encoded once per payload and read by all its servers
    (`stream.Fanout`).

One weight push, hop by hop (docs/architecture.md, section 12):
    learner/run.py:PushSink.publish            the version, from Redis's counter (common/replay/fence.py)
    Publisher.push                              this file, from here on
      Publisher.take_snapshot                   the policy's state dict (LoRA: the targets over the base)
      ServerPool.live                           the live servers (common/servers.py)
      Publisher.plan                            full or partial, shared memory or the stream
      Publisher.deliver                         every server at once, by its transport's jobs (deliver.py)
        generation/server.py:PushWeights, LoadSharedWeights
          weights/receiver.py:WeightReceiver    fence, assemble and check, swap between batches
      Publisher.register                        each server that took it: the registry shows it
      store.publish_learner                     the version and where to pull it from
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Protocol

import redis

from ..common.rpc.waits import wait_failed
from ..common.types import Progress, no_progress
from . import delta
from .deliver import Outcome, Rounds, Route
from .protocol import COMPLETE_FORMATS, PushKind, nbytes
from .transports import Delivery, Job, Reach, SharedMemoryTransport, StreamTransport

if TYPE_CHECKING:
    from ..common.config import Config

log = logging.getLogger(__name__)


class Servers(Protocol):
    """What a push asks of the pool of generation servers (common/servers.py:ServerPool)."""

    def live(self, fresh: bool = False) -> dict[str, dict]: ...  # address -> its registry entry

    def client(self, address: str): ...  # push_encoded(chunks), load_shared(request), timeout


class Publisher:
    """Publishes each new policy of `learner` to the live generation servers of `servers`
    (`push`), registering each server that took it in `store`'s registry, and keeps the newest
    snapshot, which `Learner.PullWeights` serves (`snapshot`). `identity` (run id, epoch) is the
    fence every version carries; `on_progress` runs as each server answers (the learner's
    heartbeat)."""

    def __init__(self, cfg: Config, store, learner, servers: Servers, on_progress: Progress = no_progress):
        self.cfg, self.store, self.learner, self.servers = cfg, store, learner, servers
        self._snap: tuple[int, dict, bool] = (0, {}, False)  # (policy_version, state, whether only the LoRA targets)
        self._base: dict | None = None  # LoRA: a full state whose other tensors are the frozen base
        # rpc.delta_push: the previous full snapshot, which deltas are against: (delta.base_key, version, state)
        self.delta_push = cfg.rpc.delta_push and delta.available()
        if cfg.rpc.delta_push and not self.delta_push:
            log.warning("rpc.delta_push is on but the zstandard package is missing: every version goes whole")
        self._prev: tuple[str, int, dict] | None = None
        self.pushed_to: list[str] = []  # the servers the last push went to (the learner's parity check asks them)
        self.reach = Reach(cfg, servers.client, on_progress)  # what both transports use
        self.stream = StreamTransport(self.reach)
        self.shared = SharedMemoryTransport(self.reach)

    @property
    def identity(self) -> tuple[str, int]:
        return self.reach.identity

    @identity.setter
    def identity(self, value: tuple[str, int]) -> None:
        self.reach.identity = value

    # ------------------------------------------------------------------ the push, in its order
    def push(self, policy_version: int, learner_address: str) -> dict:
        """Push `policy_version` to every live generation server, in parallel; then publish it.
        The push's metrics."""
        t0 = time.perf_counter()
        full = self.take_snapshot(policy_version)
        payloads = {PushKind.FULL: full}
        if self._snap[2]:
            payloads[PushKind.PARTIAL] = self._snap[1]
        elif self._prev is not None:
            payloads[PushKind.DELTA] = full  # as changes to the previous snapshot
        servers = self.servers.live(fresh=True)
        self.pushed_to = list(servers)
        plan = {a: self.plan(a, info, PushKind.PARTIAL in payloads) for a, info in servers.items()}
        ok = self.deliver(servers, plan, payloads, policy_version) if servers else {}
        self.store.publish_learner(learner_address, policy_version, *self.identity)
        sizes = {k: nbytes(s) for k, s in payloads.items()}
        # a delta's bytes: its encoded stream, read by every server it went to
        sizes[PushKind.DELTA] = self.stream.take_encoded().get(PushKind.DELTA, 0)
        sent = sum(sizes[o.kind] for o in ok.values()) if servers else sizes[PushKind.FULL]
        secs = time.perf_counter() - t0
        took = [o for o in ok.values() if o.took]
        return {
            "time/push_s": secs,
            "push/servers": len(servers),
            "push/failed": len(ok) - len(took),
            "push/shm": sum(o.via == self.shared.name for o in took),
            "push/partial": sum(o.kind is PushKind.PARTIAL for o in took),
            "push/delta": sum(o.kind is PushKind.DELTA for o in took),
            "push/bytes": sent,
            "push/mb_per_s": sent / max(secs, 1e-9) / 1e6,
        }

    def publish_initial(self, learner_address: str) -> None:
        """Version 0 (the initial weights every server loads): nothing to push, only to publish."""
        self.take_snapshot(0)
        self.store.publish_learner(learner_address, 0, *self.identity)

    @property
    def delta_capable(self) -> bool:
        return bool(getattr(self.learner, "lora", False)) and hasattr(self.learner, "policy_delta_state_dict")

    def take_snapshot(self, policy_version: int) -> dict:
        """Snapshot `policy_version`; its full state dict. With LoRA only the targets are taken
        (`policy_delta_state_dict`), laid over the base, which is built once."""
        if self.delta_capable:
            if self._base is None:
                self._base = self.learner.policy_state_dict()
            self._snap = (policy_version, self.learner.policy_delta_state_dict(), True)
            return self.snapshot[1]
        state = self.learner.policy_state_dict()
        if self.learner.device.type == "cpu" and not self.learner.lora and not getattr(self.learner, "sharded", False):
            # views of the live parameters (a sharded learner's gathered state is a copy already)
            state = {k: v.clone() for k, v in state.items()}
        before, prev_state, partial = self._snap
        # kept for the next push's deltas (a copy of the model in host memory, only with rpc.delta_push)
        keep = self.delta_push and prev_state and not partial and before < policy_version
        self._prev = (delta.base_key(*self.identity, before), before, prev_state) if keep else None
        self._snap = (policy_version, state, False)
        return state

    @property
    def snapshot(self) -> tuple[int, dict]:
        """(policy_version, the full state dict) of the newest version, for PullWeights."""
        policy_version, state, partial = self._snap
        if not partial:
            return policy_version, state
        assert self._base is not None  # built with the first partial snapshot
        return policy_version, {**self._base, **state}

    def plan(self, address: str, info: dict, partial: bool) -> Route:
        """How one server gets this version: FULL, PARTIAL or DELTA, over shared memory or the
        stream. A delta goes over the stream to a server whose entry says it holds the previous
        snapshot."""
        run_id = self.identity[0]
        kind = PushKind.FULL
        if partial:
            base = info.get("base", "")
            if not info.get("partial", False):
                self.reach.tell(
                    (address, "whole"), "%s gets full versions: its backend loads whole policies only", address
                )
            elif base not in (f"run:{run_id}", f"model:{self.cfg.model.path}"):
                self.reach.tell(
                    (address, base),
                    "%s gets a full version: its weights come from %s, not this run's base (%s)",
                    address,
                    base or "an unknown source",
                    self.cfg.model.path,
                )
            else:
                kind = PushKind.PARTIAL
        via = self.via(info)
        if kind is PushKind.FULL and via == self.stream.name and self._prev is not None:
            if info.get("delta_base") == self._prev[0]:
                kind = PushKind.DELTA
        return Route(kind, via)

    def via(self, info: dict) -> str:
        """The transport that reaches a server with registry entry `info`: "shm" or "grpc"."""
        return self.shared.name if self.shared.colocated(info) else self.stream.name

    def deliver(self, servers: dict, plan: dict[str, Route], payloads: dict, policy_version: int) -> dict[str, Outcome]:
        """Every server's push as `plan` says, each registered as it takes the version: each
        server's `Outcome`. A load refused from shared memory is streamed, a delta refused for its
        base is streamed whole, both in a second round (`Rounds`)."""
        base = self._prev[1:] if self._prev is not None else None
        return Rounds(self.stream, self.shared, servers, plan, payloads, policy_version, base, self._settled).run()

    def _settled(self, job: Job, address: str, info: dict, policy_version: int, kind: PushKind, via: str) -> Delivery:
        """One server's job, then its registration if it took the version."""
        delivery = job()
        if delivery is Delivery.TOOK:
            self.register(address, info, policy_version, kind, via)
        return delivery

    def register(self, address: str, info: dict, policy_version: int, kind: PushKind, via: str = "grpc") -> None:
        """The server's registry entry after it took `policy_version`: workers see the version at once,
        and the next push plans with what this one changed (a server that keeps delta bases holds
        a version that came whole or as a delta over the stream). A registry that does not answer
        (its socket timeout) is logged: the server took the version, and its own heartbeat says so."""
        fields = {k: v for k, v in info.items() if k not in ("ts", "proof")}
        fields["policy_version"] = policy_version
        if kind in COMPLETE_FORMATS and "base" in info:
            fields["base"] = f"run:{self.identity[0]}"
        if "delta_base" in info:
            held = kind in COMPLETE_FORMATS and via == self.stream.name
            fields["delta_base"] = delta.base_key(*self.identity, policy_version) if held else ""
        t0 = time.monotonic()
        try:
            self.store.heartbeat("generation", address, **fields)
        except (redis.RedisError, OSError) as e:
            log.warning(
                "%s (the server took it; its own heartbeat registers it)",
                wait_failed(f"weight push v{policy_version} to", address, "register", e, time.monotonic() - t0),
            )

    def close(self) -> None:
        self.shared.close()
