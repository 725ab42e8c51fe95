"""One thread for a service's tensor work.

Each thread that runs parallel torch ops on the CPU gets its own OpenMP team. A gRPC server hands
requests to any thread of its pool, so a server that computed in its handlers would grow one team
per handler thread, and the idle teams' threads spin on the cores the busy one needs. Running
every tensor op of a service on one dedicated thread keeps one team."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor


class ComputeThread:
    def __init__(self, name: str):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def run(self, fn, *args, **kwargs):
        """Run `fn` on the compute thread, after whatever is queued before it; its result or exception."""
        return self._pool.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False)
