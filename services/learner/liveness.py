"""The learner's liveness: a heartbeat its training loop touches as it goes, and the bound past
which a loop that has not touched it counts as stuck (its `/healthz` answers 503 and its gRPC
health "" NOT_SERVING, so that Kubernetes restarts it; it resumes from its newest checkpoint).

The heartbeat means "the loop is running", not "data is flowing": it is touched at each phase
(feeding, waiting, training, pushing, evaluating, checkpointing), at each tick of a wait (for
trajectories, for a generation server at the policy's version, for an unavailable dependency),
by every call the loop makes to another service when it returns, and at each micro-batch of
the update's forwards and each optimiser step. A learner waiting for rollouts that do not come
is alive; one blocked inside a single call that never returns is not.

The bound (`run.liveness_s`, or derived from the configuration) must outlast the longest thing
the loop legitimately does without a beat:
- a call to another service: its gRPC deadline, `rpc.timeout_s`; the longest is a weight push,
  which may take two of them (the shared-memory load refused, then the stream) plus the
  snapshot: 3 x rpc.timeout_s leaves a margin;
- a Redis command, with the client's own retries of a connection that timed out: REDIS_RETRIES
  x (socket timeout + the longest backoff) (`services.common.replay.connection.redis_worst_s`);
- one micro-batch forward or one optimiser step, a checkpoint written to disk: no configuration
  bounds these, hence the floor of 10 minutes (as long as Kubernetes waits for a start).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..common.config import Config

LIVENESS_FLOOR_S = 600.0


def liveness_bound_s(cfg: Config) -> float:
    """Seconds without a beat after which the learner's liveness fails: `run.liveness_s`, else
    max(LIVENESS_FLOOR_S, 3 x rpc.timeout_s, the worst Redis command with its retries)."""
    if cfg.run.liveness_s is not None:
        return float(cfg.run.liveness_s)
    from ..common.replay.connection import redis_worst_s

    return max(LIVENESS_FLOOR_S, 3 * cfg.rpc.timeout_s, redis_worst_s(cfg.replay))


class Heartbeat:
    """When the training loop last showed progress, and in which phase. `beat()` is cheap (a
    clock read and an assignment) and may be called from any thread."""

    def __init__(self, bound_s: float, clock=time.monotonic):
        self.bound_s, self._clock = bound_s, clock
        self._last = clock()
        self.phase = "starting"
        self.running = True  # False once the loop has ended (done, stopped, failed): nothing to watch
        self.waiting_for: str | None = None  # the dependency the loop waits for, if any
        self._lock = threading.Lock()

    def beat(self, phase: str | None = None) -> None:
        with self._lock:
            self._last = self._clock()
            if phase is not None:
                self.phase = phase

    def __call__(self, *_args, **_kwargs) -> None:
        """`beat()`, usable as any callback (`RideThrough`'s `on_wait`, `EachAnswer`, an `on_progress`)."""
        self.beat()

    def waiting(self, msg: str | None) -> None:
        """`RideThrough`'s `on_wait`: what the loop waits for (None once it is answered)."""
        self.waiting_for = msg
        self.beat()  # a retry's tick: waiting for a dependency, not stuck

    def ended(self) -> None:
        with self._lock:
            self.running = False

    def age_s(self) -> float:
        with self._lock:
            return self._clock() - self._last

    def stuck(self) -> str | None:
        """None while the loop advances (or has ended); else why its liveness fails."""
        with self._lock:
            age, phase, running = self._clock() - self._last, self.phase, self.running
        if not running or age <= self.bound_s:
            return None
        return (
            f"the training loop has not advanced for {age:.0f}s (bound {self.bound_s:.0f}s, run.liveness_s); "
            f"it was last seen in phase '{phase}'"
        )

    def status(self) -> dict:
        with self._lock:
            return {"phase": self.phase, "since_beat_s": round(self._clock() - self._last, 1), "bound_s": self.bound_s}
