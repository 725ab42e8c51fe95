"""One training model's requests in seq_id order, each applied exactly once.

The SDK numbers a training client's requests 1, 2, 3, ... (forward_backward chunks, optim_step,
the saves and loads) and submits them in that order, but the chunks of one forward_backward
arrive concurrently, the first one last. Each request is queued under its seq_id and runs on the
compute thread when the one before it has finished.

A seq_id seen again (a retry: the HTTP layer's, or a resubmission after a lost answer) is
answered with the request id it named the first time, whose result is kept with the futures:
the work never runs twice. The same seq_id with another body is refused (`seq_id_reused`), so is
one already applied whose record is no longer kept. A request that waits `wait_s` for a seq_id
that never comes fails when it is next polled (`expire`), instead of stalling the model."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from .futures import Futures, Outcome, failed, outcome_of
from .protocol import ApiError

KEPT = 1024  # seq_ids remembered per model for retries, beyond the ones queued


@dataclass
class _Queued:
    request_id: str
    future: Future
    work: Callable[[], Outcome]
    since: float


class Sequence:
    def __init__(self, submit: Callable[..., Future], max_queued: int, wait_s: float):
        """`submit(fn, arg)` queues `fn(arg)` on the compute thread."""
        self.submit, self.max_queued, self.wait_s = submit, max_queued, wait_s
        self._next = 1
        self._queued: dict[int, _Queued] = {}
        self._seen: OrderedDict[int, tuple[str, str]] = OrderedDict()  # seq_id -> (request id, digest)
        self._running = False
        self._gone: str | None = None  # why no more requests run (the model was dropped)
        self._lock = threading.Lock()

    def add(self, seq_id: int, digest: str, futures: Futures, work: Callable[[], Outcome]) -> str:
        """The request id of the request `seq_id` (its body's `digest`): a new one queued, or the
        one a retry of it names."""
        with self._lock:
            seen = self._seen.get(seq_id)
            if seen is not None:
                if seen[1] != digest:
                    raise ApiError(
                        400,
                        f"seq_id {seq_id} was already used by another request of this model",
                        param="seq_id",
                        code="seq_id_reused",
                    )
                return seen[0]
            self._admit(seq_id)
            request_id, future = futures.create()
            self._queued[seq_id] = _Queued(request_id, future, work, time.monotonic())
            self._seen[seq_id] = (request_id, digest)
            while len(self._seen) > KEPT + len(self._queued):
                self._seen.popitem(last=False)
            self._pump()
            return request_id

    def _admit(self, seq_id: int) -> None:
        if self._gone is not None:
            raise ApiError(400, self._gone, code="model_gone")
        if seq_id < self._next:
            raise ApiError(
                400,
                f"seq_id {seq_id} was applied already (and its result is no longer kept); this model's next "
                f"seq_id is {self._next}",
                param="seq_id",
                code="seq_id_applied",
            )
        if seq_id >= self._next + self.max_queued or len(self._queued) >= self.max_queued:
            raise ApiError(
                429,
                f"seq_id {seq_id}: this model runs seq_id {self._next} next and queues at most {self.max_queued} "
                "requests (tinker.max_queued_per_model)",
                param="seq_id",
                code="too_many_requests",
            )

    def _pump(self) -> None:
        """Under the lock: the next request onto the compute thread, if it is here and none runs."""
        if self._running or self._next not in self._queued:
            return
        self._running = True
        self.submit(self._run, self._queued.pop(self._next))

    def _run(self, queued: _Queued) -> None:
        queued.future.set_result(outcome_of(queued.work))
        with self._lock:
            self._running = False
            self._next += 1
            self._pump()

    def expire(self, request_id: str) -> None:
        """Fail `request_id` if it still waits, after `wait_s`, for a seq_id before it."""
        with self._lock:
            for seq_id, q in list(self._queued.items()):
                if q.request_id == request_id and time.monotonic() - q.since > self.wait_s:
                    del self._queued[seq_id]
                    q.future.set_result(
                        failed(
                            f"seq_id {seq_id} waited {self.wait_s:g} s for seq_id {self._next} of this model, "
                            "which never came (tinker.seq_wait_s)",
                            code="seq_id_gap",
                        )
                    )

    def close(self, reason: str) -> None:
        """No more requests: the queued ones fail with `reason`."""
        with self._lock:
            self._gone = reason
            for q in self._queued.values():
                q.future.set_result(failed(reason, code="model_gone"))
            self._queued.clear()
