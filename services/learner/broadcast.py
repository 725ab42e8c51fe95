"""The weight broadcaster: snapshots each new policy, pushes it to every live generation server in
parallel, publishes it in the registry (so workers and late servers see it at once), and keeps
the snapshot that `Learner.PullWeights` serves.

Each push is planned per server, from its registry entry:
- what: the full policy, or with LoRA only the merged target modules ("partial", what training
  changes) when the server's other tensors are provably this run's base: it loaded `model.path`
  (the base) and has had only partial versions since, or it holds a full version of this run; and
  its backend takes partial versions (vLLM's does not: it gets full ones);
- how: from shared memory (`rpc.shm_dir`, written once for every server on this host, proven by
  the server's probe file; `services/common/rpc/shm.py`), else the gRPC stream (encoded once per
  payload, fanned out). A shared-memory load that fails (other than an unreachable server) is
  retried over gRPC in the same push."""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import redis

from ..common.rpc import shm
from ..common.rpc.retry import DependencyUnavailable
from ..common.rpc.waits import Counted, wait_failed
from ..common.rpc.weights import Fanout, encode_weights
from ..generation.client import GenerationClient

log = logging.getLogger(__name__)

PUSH_CHUNK_BYTES = 16 << 20  # per piece; well under rpc.max_message_mb
PUSH_WINDOW_BYTES = 128 << 20  # encoded chunks held for the slowest server
UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def _nbytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _nothing() -> None:
    pass


class WeightBroadcaster:
    on_progress = staticmethod(_nothing)  # each server's push answered, each tick of a wait (the learner's heartbeat)

    def __init__(self, cfg, store, learner):
        self.cfg, self.store, self.learner = cfg, store, learner
        self._snap: tuple[int, dict, bool] = (0, {}, False)  # (version, state, whether only the LoRA targets)
        self._base: dict | None = None  # LoRA: a full state whose other tensors are the frozen base
        self._clients: dict[str, GenerationClient] = {}
        self.identity: tuple[str, int] = ("", 0)  # (run id, epoch): the fence every push carries
        self.shm: shm.SharedWeightsWriter | None = None
        self._told: set = set()

    # ------------------------------------------------------------------ the snapshot
    @property
    def delta_capable(self) -> bool:
        return bool(getattr(self.learner, "lora", False)) and hasattr(self.learner, "policy_delta_state_dict")

    @property
    def snapshot(self) -> tuple[int, dict]:
        """(version, the full state dict) of the newest version, for PullWeights."""
        version, state, partial = self._snap
        return (version, {**self._base, **state}) if partial else (version, state)

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

    def client(self, address: str) -> GenerationClient:
        if address not in self._clients:
            self._clients[address] = GenerationClient(address, self.cfg.rpc)
        return self._clients[address]

    def _tell(self, key, msg: str, *args, level=logging.INFO) -> None:
        """Log `msg` once per `key` (a server's fallback, a plan's reason)."""
        if key not in self._told:
            self._told.add(key)
            log.log(level, msg, *args)

    # ------------------------------------------------------------------ planning
    def plan(self, address: str, info: dict, partial: bool) -> tuple[str, str]:
        """(payload, transport) for one server: ("full" | "partial", "shm" | "grpc")."""
        run_id = self.identity[0]
        kind = "full"
        if partial:
            base = info.get("base", "")
            if not info.get("partial", False):
                self._tell((address, "whole"), "%s gets full versions: its backend loads whole policies only", address)
            elif base not in (f"run:{run_id}", f"model:{self.cfg.model.path}"):
                self._tell((address, base), "%s gets a full version: its weights come from %s, not this run's base "
                           "(%s)", address, base or "an unknown source", self.cfg.model.path)
            else:
                kind = "partial"
        via = "shm" if shm.colocated(self.cfg.rpc.shm_dir, info.get("shm")) else "grpc"
        return kind, via

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
            log.warning("%s (the server took it; its own heartbeat registers it)", wait_failed(
                f"weight push v{version} to", address, "register", e, time.monotonic() - t0))

    def _push_one(self, address: str, chunks, version: int, info: dict, kind: str) -> bool:
        """Push one server the (already encoded) stream `chunks`."""
        sent, t0 = Counted(chunks), time.monotonic()
        client = self.client(address)
        try:
            client.push_encoded(sent)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT and "not newer" in (e.details() or ""):
                return True  # it pulled this version itself a moment ago
            # all chunks out: the deadline passed while the server checked or swapped them in
            log.warning("%s (it will pull when it sees it is behind)", wait_failed(
                f"weight push v{version} to", address, sent.phase("stream", "apply"), e, time.monotonic() - t0,
                client.timeout))
            return False
        finally:
            self.on_progress()
        self._registered(address, info, version, kind)
        return True

    def _load_one(self, address: str, request, version: int, info: dict, kind: str) -> str:
        """Point one co-located server at the shared file: "ok", "failed", or "stream" (retry over gRPC)."""
        t0 = time.monotonic()
        client = self.client(address)
        try:
            client.load_shared(request)
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
            if code == grpc.StatusCode.INVALID_ARGUMENT and "not newer" in details:
                return "ok"
            if code in UNREACHABLE:
                log.warning("%s (it will pull when it sees it is behind)", wait_failed(
                    f"weight push v{version} to", address, "shm-load", e, time.monotonic() - t0, client.timeout))
                return "failed"
            self._tell((address, "stream"), "shared-memory load of version %d refused by %s (%s: %s); streaming "
                       "over gRPC instead", version, address, code.name, details, level=logging.WARNING)
            return "stream"
        finally:
            self.on_progress()
        self._registered(address, info, version, kind)
        return "ok"

    def chunk_bytes(self) -> int:
        return max(1 << 20, min(PUSH_CHUNK_BYTES, self.cfg.rpc.max_message_mb * (1 << 20) // 2))

    def _stream(self, pool, targets: list, state: dict, kind: str, version: int, fans: list) -> dict:
        """Stream `state` to every (address, info) of `targets`, one encoding read by all: {address: future}."""
        run_id, epoch = self.identity
        chunk = self.chunk_bytes()
        fan = Fanout(encode_weights(state, version, chunk, fmt=kind, run_id=run_id, epoch=epoch), len(targets),
                     window=max(2, PUSH_WINDOW_BYTES // chunk))
        fans.append(fan)

        def one(i, address, info):
            try:
                return self._push_one(address, fan.reader(i), version, info, kind)
            finally:
                fan.detach(i)  # a failed stream no longer holds the others back
        return {a: pool.submit(one, i, a, info) for i, (a, info) in enumerate(targets)}

    def _write_shared(self, state: dict, version: int, kind: str):
        """The version written into shared memory (the request that points a server at it); None
        when it cannot be written (then its servers get the stream)."""
        run_id, epoch = self.identity
        try:
            if self.shm is None or self.shm.run_id != run_id:
                self.shm = shm.SharedWeightsWriter(self.cfg.rpc.shm_dir, run_id)
                self.shm.cleanup()  # what an earlier learner process of this run left
            return self.shm.write(state, version, epoch, kind)
        except (OSError, TypeError) as e:
            self._tell(("shm-write", type(e)), "cannot write version %d into rpc.shm_dir %s (%s); streaming over gRPC",
                       version, self.cfg.rpc.shm_dir, e, level=logging.WARNING)
            return None

    def _deliver(self, servers: dict, plan: dict, payloads: dict, version: int) -> dict[str, tuple[bool, str]]:
        """Every server's push as planned: {address: (took it, "shm" | "grpc")}."""
        groups: dict[tuple[str, str], list] = {}
        for a, (kind, via) in plan.items():
            groups.setdefault((kind, via), []).append((a, servers[a]))
        fans: list = []
        ok: dict[str, tuple[bool, str]] = {}
        # every server's stream or load runs at once (a Fanout needs all its readers reading)
        with ThreadPoolExecutor(max_workers=max(1, 2 * len(servers))) as pool:
            futures = {}
            for (kind, via), targets in groups.items():
                if via == "grpc":
                    futures.update(self._stream(pool, targets, payloads[kind], kind, version, fans))
            shared = set()
            for (kind, via), targets in groups.items():
                if via == "shm":
                    request = self._write_shared(payloads[kind], version, kind)
                    if request is None:
                        futures.update(self._stream(pool, targets, payloads[kind], kind, version, fans))
                    else:
                        shared.update(a for a, _ in targets)
                        futures.update({a: pool.submit(self._load_one, a, request, version, info, kind)
                                        for a, info in targets})
            retry: dict[str, list] = {}
            for a, f in futures.items():
                result = f.result()
                if result == "stream":
                    retry.setdefault(plan[a][0], []).append((a, servers[a]))
                ok[a] = (result in (True, "ok"), "shm" if a in shared else "grpc")
            for kind, targets in retry.items():
                ok.update({a: (f.result(), "grpc") for a, f in self._stream(pool, targets, payloads[kind], kind,
                                                                           version, fans).items()})
        for fan in fans:
            fan.join()
        return ok

    def push(self, version: int, learner_address: str) -> dict:
        """Push policy `version` to every live generation server, in parallel; then publish it."""
        t0 = time.perf_counter()
        full = self.take_snapshot(version)
        payloads = {"full": full}
        if self._snap[2]:
            payloads["partial"] = self._snap[1]
        servers = dict(self.store.live("generation"))
        plan = {a: self.plan(a, info, "partial" in payloads) for a, info in servers.items()}
        ok = self._deliver(servers, plan, payloads, version) if servers else {}
        self.store.publish_learner(learner_address, version, *self.identity)
        sizes = {k: _nbytes(s) for k, s in payloads.items()}
        sent = sum(sizes[kind] for kind, _ in plan.values()) if servers else sizes["full"]
        secs = time.perf_counter() - t0
        return {"time/push_s": secs, "push/servers": len(servers), "push/failed": sum(not v for v, _ in ok.values()),
                "push/shm": sum(v and via == "shm" for v, via in ok.values()),
                "push/partial": sum(ok[a][0] and kind == "partial" for a, (kind, _) in plan.items()),
                "push/bytes": sent, "push/mb_per_s": sent / max(secs, 1e-9) / 1e6}

    def publish_initial(self, learner_address: str) -> None:
        """Version 0 (the initial weights every server loads): nothing to push, only to publish."""
        self.take_snapshot(0)
        self.store.publish_learner(learner_address, 0, *self.identity)

    def serving(self, version: int, timeout_s: float | None, stop_event, avoid: dict | None = None) -> GenerationClient:
        """A client of a live generation server at `version` or newer (the eval target), except
        those `avoid` maps to a time still ahead; waits up to `timeout_s` (None = until stopped)."""
        avoid = avoid if avoid is not None else {}
        deadline = None if timeout_s is None else time.time() + timeout_s
        while True:
            live = [a for a, i in self.store.live("generation").items()
                    if i.get("version", -1) >= version and avoid.get(a, 0) <= time.time()]
            if live:
                return self.client(sorted(live)[0])
            if (deadline is not None and time.time() > deadline) or stop_event.is_set():
                raise DependencyUnavailable(f"no generation server serves policy version {version} for the eval")
            self.on_progress()  # a wait's tick: waiting for a server, not stuck
            stop_event.wait(0.2)

    def close(self) -> None:
        for c in self._clients.values():
            c.close()
        if self.shm is not None:
            self.shm.cleanup()
