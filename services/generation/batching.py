"""How Generate calls become backend work: `Batcher` (concurrent calls merged into backend batches
by one compute thread, weight swaps between them, or between two decoding steps of the running
batch with generation.weight_update: in_flight), `ContinuousBatcher` (the same faces for a
backend that batches by itself: vLLM), `make_batcher` (which of the two a backend gets) and
`InFlight` (a retry with the first call's idempotency key waits for the work still running
instead of starting a second copy)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ..common.compute import Call, run_call, wait_for_call
from ..common.rpc.errors import DeadlineExceeded
from ..common.types import GenerationBackend, GenerationResult, SamplingParams
from .backend import GenerationStopped
from .metrics import GenerationMetrics

if TYPE_CHECKING:
    from ..common.config import Config

log = logging.getLogger(__name__)


def _never() -> bool:
    return False


@dataclass
class _Job:
    prompts: list[list[int]]
    params: SamplingParams
    future: Future
    stopped: Callable[[], bool] = _never  # True once nobody waits for this job (sticky)


class ActiveCalls:
    """`active`: the Generate calls inside the server (decoding, queued or running), counted by the
    servicer with `enter`/`exit` from the moment a request arrives."""

    def __init__(self):
        self.active = 0
        self._active_lock = threading.Lock()

    def enter(self) -> None:
        with self._active_lock:
            self.active += 1

    def exit(self) -> None:
        with self._active_lock:
            self.active -= 1


class Batcher(ActiveCalls):
    """Collects concurrent Generate calls for up to `window_s` (or `max_batch_size` prompts) and
    runs each group of calls with equal sampling parameters as one backend batch. Calls with a
    seed run alone, so their samples do not depend on what else was in flight.

    The window is only waited for while other calls are in the server (`active`, counted by the
    servicer from the moment a request arrives): a lone caller runs at once, and calls that
    queued while a batch was running join the next batch without waiting.

    A job whose `stopped()` is True when its turn comes is dropped; a running batch is given
    `stop`: True once every job in it is stopped, which ends it at the next decoding step. Jobs
    dropped or stopped raise `GenerationStopped`.

    The batcher's own thread is the server's one compute thread (the reason is in
    `services/common/compute.py`): weight swaps run on it too (`call`), between batches; with
    `in_flight`, also between two decoding steps of the running batch (the backend's `between`),
    so a swap waits for one step, not for the batch's longest sample."""

    def __init__(
        self, backend: GenerationBackend, max_batch_size: int, window_s: float, metrics=None, in_flight: bool = False
    ):
        self.backend, self.max_batch_size, self.window_s, self.metrics = backend, max_batch_size, window_s, metrics
        self.in_flight = in_flight
        self._urgent: deque[Call] = deque()  # in_flight: calls the running batch takes between steps
        self.q: queue.Queue[_Job | Call | None] = queue.Queue()
        self.batches = 0
        super().__init__()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="generation-batcher", daemon=True)
        self._thread.start()

    def dead(self) -> str | None:
        """Why nothing can run any more (the server's liveness fails then), or None."""
        if not self._closed and not self._thread.is_alive():
            return "the generation-batcher thread has exited; nothing is decoded or swapped any more"
        return None

    def start(self, prompts: list[list[int]], params: SamplingParams, stopped: Callable[[], bool] = _never) -> Future:
        """Queue a job; its future's result is its `GenerationResult`."""
        fut: Future = Future()
        self.q.put(_Job(prompts, params, fut, stopped))
        return fut

    def close(self) -> None:
        self._closed = True
        self.q.put(None)

    def call(self, fn, *args, timeout: float | None = None):
        """Run fn(*args) on the batcher's thread between batches; its result or exception. With a
        `timeout`: not started within it (the running batch still decoding), it is withdrawn and
        `CallNotStarted` raised (`wait_for_call`)."""
        fut: Future = Future()
        c = Call(lambda: fn(*args), fut)
        if self.in_flight:
            self._urgent.append(c)  # the running batch takes it at its next step; else the loop, below
        self.q.put(c)
        return wait_for_call(fut, timeout)

    def _run_urgent(self) -> None:
        """The calls queued while a batch decodes, run between two of its steps (in_flight)."""
        while self._urgent:
            c = self._urgent.popleft()
            _run_once(c)

    def _loop(self) -> None:
        while True:
            job = self.q.get()
            if job is None:
                return
            if isinstance(job, Call):
                _run_once(job)
                continue
            jobs = [job]
            deferred: list[Call] = []
            size = len(job.prompts)
            deadline = time.monotonic() + self.window_s
            while size < self.max_batch_size:
                remaining = deadline - time.monotonic()
                if self.q.empty() and (remaining <= 0 or self.active <= len(jobs)):
                    break  # nobody else is coming (or the window is over)
                try:
                    nxt = self.q.get(timeout=max(remaining, 0)) if remaining > 0 else self.q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self.q.put(None)
                    break
                if isinstance(nxt, Call):
                    deferred.append(nxt)
                    break
                jobs.append(nxt)
                size += len(nxt.prompts)
            groups: dict = {}
            for j in jobs:
                p = j.params
                key = (
                    p.n,
                    p.temperature,
                    p.top_p,
                    p.top_k,
                    p.max_new_tokens,
                    tuple(p.stop_token_ids),
                    id(j) if p.seed is not None else None,
                )
                groups.setdefault(key, []).append(j)
            for group in groups.values():
                self._run(group)
            for c in deferred:
                _run_once(c)

    def _run(self, group: list[_Job]) -> None:
        for j in group:
            if j.stopped():
                j.future.set_exception(GenerationStopped("nobody waits for this request any more; not run"))
        group = [j for j in group if not j.future.done()]
        if not group:
            return
        prompts = [p for j in group for p in j.prompts]
        between = {"between": self._run_urgent} if self.in_flight else {}  # weight updates between steps
        stop = [j.stopped for j in group]
        try:
            res = self.backend.generate(prompts, group[0].params, stop=lambda: all(s() for s in stop), **between)
        except GenerationStopped as e:
            log.info("a batch of %d prompts was stopped: every caller left (%s)", len(prompts), e)
            for j in group:
                j.future.set_exception(e)
            return
        except Exception as e:  # every caller of the batch sees the error
            for j in group:
                j.future.set_exception(e)
            return
        self.batches += 1
        record_batch(self.metrics, len(prompts), res)
        start = 0
        for j in group:
            n = len(j.prompts)
            share = res.completions[start : start + n]
            start += n
            if j.stopped():  # its caller left while the others' rows were decoded: its rows are nobody's
                j.future.set_exception(GenerationStopped("nobody waits for this request any more"))
                continue
            j.future.set_result(
                GenerationResult(
                    share, res.policy_version, sum(len(c.token_ids) for cs in share for c in cs), res.seconds
                )
            )


def _run_once(c: Call) -> None:
    """A call is queued twice with in_flight (for the running batch's steps and for the loop):
    whichever reaches it first runs it (both on the compute thread, so never at once)."""
    if not (c.future.running() or c.future.done()):  # done: run, or withdrawn by its caller
        run_call(c.future, c.fn)


def record_batch(metrics: GenerationMetrics | None, n_prompts: int, res: GenerationResult) -> None:
    if metrics is not None:
        metrics.record(n_prompts, res)


class ContinuousBatcher(ActiveCalls):
    """The `Batcher` of a backend that batches by itself (vLLM's continuous batching): the same
    `start`/`call`/`close`/`enter`/`exit`, each call handed to the backend as it comes
    (the backend aborts a job once its `stopped()` is True)."""

    def __init__(self, backend, metrics=None):
        self.backend, self.metrics = backend, metrics
        self.batches = 0
        super().__init__()
        self._lock = threading.Lock()

    def start(self, prompts: list[list[int]], params: SamplingParams, stopped: Callable[[], bool] = _never) -> Future:
        fut = self.backend.submit(prompts, params, stopped)

        def done(f: Future) -> None:
            if not f.cancelled() and f.exception() is None:
                with self._lock:
                    self.batches += 1
                record_batch(self.metrics, len(prompts), f.result())

        fut.add_done_callback(done)
        return fut

    def call(self, fn, *args, timeout: float | None = None):
        return self.backend.call(fn, *args, timeout=timeout)

    def close(self) -> None:
        self.backend.close()

    def dead(self) -> str | None:
        return self.backend.dead()


def make_batcher(backend: GenerationBackend, cfg: Config, metrics: GenerationMetrics | None = None):
    """The batcher `backend` gets: its own continuous batching (vLLM), or `Batcher` with the
    config's batch size and window, taking weight updates between decoding steps with
    generation.weight_update: in_flight."""
    g = cfg.generation
    if getattr(backend, "continuous_batching", False):
        return ContinuousBatcher(backend, metrics)
    in_flight = g.weight_update == "in_flight"
    return Batcher(backend, g.max_batch_size, g.batch_window_ms / 1000, metrics, in_flight=in_flight)


class _Work:
    """One Generate's computation and the calls waiting for it (several when retries attached)."""

    def __init__(self, key: str | None):
        self.key = key
        self.contexts: list = []
        self.future: Future | None = None
        self.abandoned = False


class InFlight:
    """Generate calls by idempotency key: a call whose key (with the same request) names work
    still running waits for that work instead of starting another copy. Work is abandoned (its
    `stopped()` turns True, for good) once none of its callers' gRPC contexts is active; an
    abandoned work leaves the table in the same step, under the same lock as attaching, so a
    retry either attaches to work that will deliver or starts anew, never joins work that is
    stopping. Work without a key is the same, with its one caller."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[str, _Work] = {}

    def run(self, key: str | None, context, start: Callable[[Callable[[], bool]], Future]) -> GenerationResult:
        """The result of the work under `key`: running work's, or `start(stopped)`'s (a future)."""
        with self._lock:
            running = self._by_key.get(key) if key is not None else None
            new = running is None
            if running is None:
                work = _Work(key)
                # start only queues the work (it calls nothing back before returning); work it
                # refuses (a full queue, a stopping server) never enters the table
                work.future = start(lambda: self._stopped(work))
                if key is not None:
                    self._by_key[key] = work
            else:
                work = running
            work.contexts.append(context)
        future = work.future
        assert future is not None  # set under the lock, before any other call can find the work
        if new and key is not None:
            future.add_done_callback(lambda _: self._forget(work))
        elif not new:
            log.info("Generate %s: a retry of work still running; it waits for that work", key)
        try:
            return future.result()
        except GenerationStopped:
            raise DeadlineExceeded(
                "request: its caller left (deadline passed or call cancelled), so its generation was stopped"
            ) from None

    def _stopped(self, work: _Work) -> bool:
        with self._lock:
            if not work.abandoned and not any(c is None or c.is_active() for c in work.contexts):
                work.abandoned = True
                self._forget_locked(work)
            return work.abandoned

    def _forget(self, work: _Work) -> None:
        with self._lock:
            self._forget_locked(work)

    def _forget_locked(self, work: _Work) -> None:
        if work.key is not None and self._by_key.get(work.key) is work:
            del self._by_key[work.key]

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_key)
