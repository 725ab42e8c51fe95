"""Every wait of the system has a deadline (gRPC calls their `timeout=`, Redis commands their
socket timeouts, a weight swap the push's remaining deadline), and when one passes the log says
which wait, which phase and which peer, in one shape:

    weight push v12 to 10.0.0.5:50051: phase=stream (chunk 40) timed out after 120 s (deadline 120 s): ...

`wait_failed` writes that line; `Counted` tells a stream's phases apart (still sending, or
everything sent and the peer working on it).
"""

from __future__ import annotations

from typing import Iterable, Iterator

import grpc


def is_timeout(e: BaseException) -> bool:
    """A passed deadline: gRPC's DEADLINE_EXCEEDED, a socket or Redis timeout, our DeadlineExceeded."""
    if isinstance(e, grpc.RpcError) and hasattr(e, "code"):
        return e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    return isinstance(e, TimeoutError) or type(e).__name__ in ("DeadlineExceeded", "TimeoutError")


def describe(e: BaseException) -> str:
    if isinstance(e, grpc.RpcError) and hasattr(e, "code"):
        return f"{e.code().name}: {(e.details() or '').strip()[:300]}"
    return f"{type(e).__name__}: {str(e)[:300]}"


def wait_failed(
    what: str, peer: str, phase: str, error: BaseException, elapsed_s: float, deadline_s: float | None = None
) -> str:
    """'<what> <peer>: phase=<phase> timed out after N s (deadline D s): <error>' (or 'failed
    after'), e.g. what='weight push v12 to', peer='10.0.0.5:50051', phase='stream'."""
    if is_timeout(error):
        how = f"timed out after {elapsed_s:.0f} s" + (f" (deadline {deadline_s:g} s)" if deadline_s else "")
    else:
        how = f"failed after {elapsed_s:.1f} s"
    return f"{what} {peer}: phase={phase} {how}: {describe(error)}"


class Counted:
    """An iterator over `items` that counts what was taken and knows whether it ran out: a push
    whose every chunk went out failed in the peer's apply phase, not in the stream."""

    def __init__(self, items: Iterable):
        self._it: Iterator = iter(items)
        self.n, self.done = 0, False

    def __iter__(self) -> "Counted":
        return self

    def __next__(self):
        try:
            item = next(self._it)
        except StopIteration:
            self.done = True
            raise
        self.n += 1
        return item

    def phase(self, sending: str = "stream", after: str = "apply") -> str:
        """`after` once everything was taken, else `sending` with how far it got."""
        return after if self.done else f"{sending} (after {self.n} chunks)"
