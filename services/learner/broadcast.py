"""The weight broadcaster: snapshots each new policy, pushes it to every live generation server in
parallel, publishes it in the registry (so workers and late servers see it at once), and keeps
the snapshot that `Learner.PullWeights` serves.

Each push is planned per server, from its registry entry:
- what: the full policy, or with LoRA only the merged target modules ("partial", what training
  changes) when the server's other tensors are provably this run's base: it loaded `model.path`
  (the base) and has had only partial versions since, or it holds a full version of this run; and
  its backend takes partial versions (vLLM's does not: it gets full ones);
- how: from shared memory (`rpc.shm_dir`, written once for every server on this host, proven by
  the server's probe file), else the gRPC stream (encoded once per payload, fanned out). A
  shared-memory load that fails (other than an unreachable server) is retried over gRPC in the
  same push. The delivery itself is `services/weights/publisher.py`'s."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import redis

from ..common.rpc.waits import wait_failed
from ..common.types import Progress, no_progress
from ..generation.client import ServerPool
from ..weights.protocol import nbytes
from ..weights.publisher import Delivery, Publisher

if TYPE_CHECKING:
    from ..common.config import Config

log = logging.getLogger(__name__)


class WeightBroadcaster:
    def __init__(
        self, cfg: Config, store, learner, servers: ServerPool | None = None, on_progress: Progress = no_progress
    ):
        """`servers`: the pool of generation servers the learner shares (its eval's too); by
        default one of its own over `store`'s registry. `on_progress`: called as each server's
        push is answered."""
        self.cfg, self.store, self.learner = cfg, store, learner
        self._owns_servers = servers is None
        self.servers = servers or ServerPool(lambda: store.live("generation"), cfg.rpc, cfg.replay.heartbeat_s / 2)
        self._snap: tuple[int, dict, bool] = (0, {}, False)  # (version, state, whether only the LoRA targets)
        self._base: dict | None = None  # LoRA: a full state whose other tensors are the frozen base
        self.publisher = Publisher(cfg, self.servers.client, self._registered, on_progress=on_progress)

    @property
    def identity(self) -> tuple[str, int]:
        """(run id, epoch): the fence every push carries."""
        return self.publisher.identity

    @identity.setter
    def identity(self, value: tuple[str, int]) -> None:
        self.publisher.identity = value

    @property
    def shm(self):
        """The shared-memory writer (None until a version was written)."""
        return self.publisher.shared.writer

    # ------------------------------------------------------------------ the snapshot
    @property
    def delta_capable(self) -> bool:
        return bool(getattr(self.learner, "lora", False)) and hasattr(self.learner, "policy_delta_state_dict")

    @property
    def snapshot(self) -> tuple[int, dict]:
        """(version, the full state dict) of the newest version, for PullWeights."""
        version, state, partial = self._snap
        if not partial:
            return version, state
        assert self._base is not None  # built with the first partial snapshot
        return version, {**self._base, **state}

    def take_snapshot(self, version: int) -> dict:
        """Snapshot policy `version`; its full state dict. With LoRA only the targets are taken
        (`policy_delta_state_dict`), laid over the base, which is built once."""
        if self.delta_capable:
            if self._base is None:
                self._base = self.learner.policy_state_dict()
            self._snap = (version, self.learner.policy_delta_state_dict(), True)
            return self.snapshot[1]
        state = self.learner.policy_state_dict()
        if self.learner.device.type == "cpu" and not self.learner.lora and not getattr(self.learner, "sharded", False):
            # views of the live parameters (a sharded learner's gathered state is a copy already)
            state = {k: v.clone() for k, v in state.items()}
        self._snap = (version, state, False)
        return state

    # ------------------------------------------------------------------ planning
    def plan(self, address: str, info: dict, partial: bool) -> tuple[str, str]:
        """(payload, transport) for one server: ("full" | "partial", "shm" | "grpc")."""
        run_id = self.identity[0]
        kind = "full"
        if partial:
            base = info.get("base", "")
            if not info.get("partial", False):
                self.publisher.tell(
                    (address, "whole"), "%s gets full versions: its backend loads whole policies only", address
                )
            elif base not in (f"run:{run_id}", f"model:{self.cfg.model.path}"):
                self.publisher.tell(
                    (address, base),
                    "%s gets a full version: its weights come from %s, not this run's base (%s)",
                    address,
                    base or "an unknown source",
                    self.cfg.model.path,
                )
            else:
                kind = "partial"
        return kind, self.publisher.via(info)

    # ------------------------------------------------------------------ delivery
    def _registered(self, address: str, info: dict, version: int, kind: str) -> None:
        """The server's registry entry after it took `version`: workers see the version at once,
        and the next push plans with what this one changed. A registry that does not answer (its
        socket timeout) is logged: the server took the version, and its own heartbeat says so."""
        fields = {k: v for k, v in info.items() if k not in ("ts", "proof")}
        fields["version"] = version
        if kind == "full" and "base" in info:
            fields["base"] = f"run:{self.identity[0]}"
        t0 = time.monotonic()
        try:
            self.store.heartbeat("generation", address, **fields)
        except (redis.RedisError, OSError) as e:
            log.warning(
                "%s (the server took it; its own heartbeat registers it)",
                wait_failed(f"weight push v{version} to", address, "register", e, time.monotonic() - t0),
            )

    def push(self, version: int, learner_address: str) -> dict:
        """Push policy `version` to every live generation server, in parallel; then publish it."""
        t0 = time.perf_counter()
        full = self.take_snapshot(version)
        payloads = {"full": full}
        if self._snap[2]:
            payloads["partial"] = self._snap[1]
        servers = self.servers.live(fresh=True)
        plan = {a: self.plan(a, info, "partial" in payloads) for a, info in servers.items()}
        ok = self.publisher.deliver(servers, plan, payloads, version) if servers else {}
        self.store.publish_learner(learner_address, version, *self.identity)
        sizes = {k: nbytes(s) for k, s in payloads.items()}
        sent = sum(sizes[kind] for kind, _ in plan.values()) if servers else sizes["full"]
        secs = time.perf_counter() - t0
        took = {a for a, (d, _) in ok.items() if d is Delivery.TOOK}
        return {
            "time/push_s": secs,
            "push/servers": len(servers),
            "push/failed": len(ok) - len(took),
            "push/shm": sum(a in took and via == "shm" for a, (_, via) in ok.items()),
            "push/partial": sum(a in took and kind == "partial" for a, (kind, _) in plan.items()),
            "push/bytes": sent,
            "push/mb_per_s": sent / max(secs, 1e-9) / 1e6,
        }

    def publish_initial(self, learner_address: str) -> None:
        """Version 0 (the initial weights every server loads): nothing to push, only to publish."""
        self.take_snapshot(0)
        self.store.publish_learner(learner_address, 0, *self.identity)

    def close(self) -> None:
        self.publisher.close()
        if self._owns_servers:
            self.servers.close()
