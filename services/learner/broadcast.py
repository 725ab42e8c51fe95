"""The weight broadcaster: snapshots each new policy, pushes it to every live generation server in
parallel, publishes it in the registry (so workers and late servers see it at once), and keeps
the snapshot that `Learner.PullWeights` serves."""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from ..common.rpc.codec import Fanout, encode_weights
from ..common.rpc.retry import DependencyUnavailable
from ..generation.client import GenerationClient

log = logging.getLogger(__name__)

PUSH_CHUNK_BYTES = 16 << 20  # per piece; well under rpc.max_message_mb
PUSH_WINDOW_BYTES = 128 << 20  # encoded chunks held for the slowest server


class WeightBroadcaster:
    def __init__(self, cfg, store, learner):
        self.cfg, self.store, self.learner = cfg, store, learner
        self.snapshot: tuple[int, dict] = (0, {})  # (version, state dict) for PullWeights
        self._clients: dict[str, GenerationClient] = {}
        self.identity: tuple[str, int] = ("", 0)  # (run id, epoch): the fence every push carries

    def take_snapshot(self, version: int) -> dict:
        state = self.learner.policy_state_dict()
        if self.learner.device.type == "cpu" and not self.learner.lora:  # views of the live parameters
            state = {k: v.clone() for k, v in state.items()}
        self.snapshot = (version, state)
        return state

    def client(self, address: str) -> GenerationClient:
        if address not in self._clients:
            self._clients[address] = GenerationClient(address, self.cfg.rpc)
        return self._clients[address]

    def _push_one(self, address: str, chunks, version: int) -> bool:
        """Push one server the (already encoded) stream `chunks`."""
        try:
            self.client(address).push_encoded(chunks)
            self.store.heartbeat("generation", address, version=version)  # workers see it at once
            return True
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT and "not newer" in (e.details() or ""):
                return True  # it pulled this version itself a moment ago
            log.warning("push of version %d to %s failed: %s %s (it will pull when it sees it is behind)",
                        version, address, e.code().name, e.details())
            return False

    def chunk_bytes(self) -> int:
        return max(1 << 20, min(PUSH_CHUNK_BYTES, self.cfg.rpc.max_message_mb * (1 << 20) // 2))

    def push(self, version: int, learner_address: str) -> dict:
        """Push policy `version` to every live generation server, in parallel; then publish it.
        The version is serialised once, by one encoder thread, into a bounded window of chunks
        that every server's stream reads (`Fanout`)."""
        t0 = time.perf_counter()
        state = self.take_snapshot(version)
        servers = list(self.store.live("generation"))
        failed = 0
        if servers:
            run_id, epoch = self.identity
            chunk = self.chunk_bytes()
            fan = Fanout(encode_weights(state, version, chunk, run_id=run_id, epoch=epoch), len(servers),
                         window=max(2, PUSH_WINDOW_BYTES // chunk))

            def one(i_address):
                i, address = i_address
                try:
                    return self._push_one(address, fan.reader(i), version)
                finally:
                    fan.detach(i)  # a failed stream no longer holds the others back
            with ThreadPoolExecutor(max_workers=min(len(servers), 16)) as pool:
                failed = sum(not ok for ok in pool.map(one, enumerate(servers)))
            fan.join()
        self.store.publish_learner(learner_address, version, *self.identity)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        secs = time.perf_counter() - t0
        return {"time/push_s": secs, "push/servers": len(servers), "push/failed": failed,
                "push/mb_per_s": nbytes * max(len(servers), 1) / max(secs, 1e-9) / 1e6}

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
            stop_event.wait(0.2)

    def close(self) -> None:
        for c in self._clients.values():
            c.close()
