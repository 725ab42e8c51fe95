"""Work handed to the one thread that owns a service's tensors.

Each thread that runs parallel torch ops on the CPU gets its own OpenMP team. A gRPC server hands
requests to any thread of its pool, so a server that computed in its handlers would grow one team
per handler thread, and the idle teams' threads spin on the cores the busy one needs. Running
every tensor op of a service on one dedicated thread keeps one team.

Two shapes of it: `ComputeThread`, a thread of its own that runs each call in order (the critic,
the Tinker API); and a loop that owns its thread already (the generation batcher, the vLLM
engine's thread), to which other work is handed as a `Call`: queued with its future
(`wait_for_call` on the caller's side, `run_call` on the loop's), it runs between that loop's
batches."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Callable


class ComputeThread:
    def __init__(self, name: str):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def run(self, fn, *args, **kwargs):
        """Run `fn` on the compute thread, after whatever is queued before it; its result or exception."""
        return self.submit(fn, *args, **kwargs).result()

    def submit(self, fn, *args, **kwargs) -> Future:
        """Queue `fn` on the compute thread, after whatever is queued before it; its Future (for a
        caller that does not wait: the Tinker API's requests)."""
        return self._pool.submit(fn, *args, **kwargs)

    def close(self) -> None:
        self._pool.shutdown(wait=False)


@dataclass
class Call:
    """Work for a loop's thread other than its own (a weight swap): it runs between batches."""

    fn: Callable[[], object]
    future: Future


class CallNotStarted(TimeoutError):
    """A call for the compute thread (a weight swap) that had not started when its wait's deadline
    passed (the running batch was still decoding): it was withdrawn, nothing changed."""


def wait_for_call(fut: Future, timeout: float | None):
    """The result of a call queued for the compute thread: waiting up to `timeout` seconds for it
    to start (None = as long as it takes); one still queued then is withdrawn (`CallNotStarted`);
    one that has started is waited for to the end (it holds what it was given)."""
    try:
        return fut.result(timeout)
    except FutureTimeout:
        if fut.cancel():
            raise CallNotStarted(f"it waited {timeout:.0f} s for the running batch to finish and never ran") from None
        return fut.result()


def run_call(fut: Future, fn: Callable[[], object]) -> None:
    """The compute thread's side of `wait_for_call`: `fn()` into `fut`, unless its caller withdrew
    it (then nothing runs); an exception goes to the caller."""
    if not fut.set_running_or_notify_cancel():
        return  # withdrawn by its caller, whose wait ran out
    try:
        fut.set_result(fn())
    except BaseException as e:  # the caller sees it
        fut.set_exception(e)
