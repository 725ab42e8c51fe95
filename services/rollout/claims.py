"""A rollout worker's claims on prompts: the loop that claims a batch (a silent worker's idle
prompts first, XAUTOCLAIM, then new ones, XREADGROUP) and hands it on, and the renewal of that
claim while the batch is worked on. A worker killed mid-batch leaves its prompts pending; another
worker reclaims them after `replay.claim_idle_s`. A live worker renews its claim while it works,
so a slow batch (or one waiting for a restarting service) is never taken over.

    ClaimLoop.run          until stopped: pause while the buffer is full, else claim a batch
      ClaimRenewal         while `process(entries)` works on it, the claim renewed
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable

from ..common.replay import ReplayStore, redis_error_code
from .metrics import WorkerMetrics

if TYPE_CHECKING:
    from ..common.config import Config

log = logging.getLogger("services.rollout.worker")  # the worker's log lines read as they did in one module


class ClaimLoop:
    """One batch loop of a worker (it runs `rollout.concurrency` of them): while fewer than
    `max_backlog` groups wait for the learner, claim up to `rollout.prompts_per_request` prompts
    as `consumer` and hand them to `process`, their claim renewed meanwhile; until `stop_event`."""

    def __init__(
        self,
        cfg: Config,
        store: ReplayStore,
        consumer: str,
        process: Callable[[list], object],
        stop_event: threading.Event,
        metrics: WorkerMetrics,
    ):
        self.cfg, self.store, self.consumer, self.process = cfg, store, consumer, process
        self.stop_event, self.metrics = stop_event, metrics

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                self._once()
            except Exception as e:  # Redis restarting, a stream reset by a new run, ...
                if redis_error_code(e) == "NOGROUP":
                    self.store.ensure_groups()
                    continue
                self.metrics.error("loop").inc()
                log.exception("rollout loop error; retrying in 1s")
                self.stop_event.wait(1.0)

    def _once(self) -> None:
        rc = self.cfg.replay
        if self.store.backlog() >= self.cfg.max_backlog:
            t0 = time.time()
            self.stop_event.wait(rc.block_ms / 1000)
            self.metrics.backpressure.inc(time.time() - t0)
            return
        entries, reclaimed = self.store.claim_prompts(self.consumer, self.cfg.rollout.prompts_per_request, rc.block_ms)
        if not entries:
            return
        self.metrics.claimed.inc(len(entries))
        if reclaimed:
            self.metrics.reclaimed.inc(reclaimed)
            log.info("reclaimed %d prompts from a silent worker", reclaimed)
        self.metrics.in_flight.inc()
        try:
            with ClaimRenewal(self.store, self.consumer, [e for e, _ in entries], rc.claim_idle_s / 3):
                self.process(entries)
        finally:
            self.metrics.in_flight.dec()


class ClaimRenewal:
    """While a batch is worked on, re-claim its prompts every claim_idle_s / 3 (their idle time
    restarts), so other workers see a live owner and leave them alone."""

    def __init__(self, store: ReplayStore, consumer: str, entry_ids: list, every_s: float):
        self.store, self.consumer, self.ids, self.every_s = store, consumer, entry_ids, every_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="claim-renewal", daemon=True)

    def _loop(self) -> None:
        while not self._done.wait(self.every_s):
            try:
                self.store.renew_claims(self.consumer, self.ids)
            except Exception as e:  # Redis restarting: the next renewal tries again
                log.warning("could not renew the claim on %d prompts: %s", len(self.ids), e)

    def __enter__(self) -> "ClaimRenewal":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(timeout=5)
