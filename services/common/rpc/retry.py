"""What a client needs around every call, as gRPC client interceptors (a client is built with
them: `CriticClient(addr, cfg.rpc, interceptors=[...])`), in the order given, the first outermost:

- `RideThrough`: riding through a restart. A call that found its service unavailable (a server
  restarting, a connection refused) is repeated with exponential backoff, for as long as the
  caller is willing to wait, and says what it waits for; then `DependencyUnavailable`.
- `Tagged`: a failed call's `grpc.RpcError` says which service it came from (`e.service`), for a
  caller that calls several services in one step (the rollout worker).
- `EachAnswer`: a callback after every call, answered or failed (the learner's heartbeat).

    critic = CriticClient(addr, cfg.rpc, interceptors=[RideThrough("critic server", addr, cfg.rpc, stop_event)])
    critic.values(batch)      # UNAVAILABLE -> wait 0.2 s, 0.4 s, ... (at most rpc.retry_max_backoff_s)

Repeated: UNAVAILABLE for every method (the call did not reach a live server, or the server went
away; a restarted server comes back to a defined state, so a repeat is safe), and
DEADLINE_EXCEEDED for methods that only read (`idempotent`), unless the error carries a `Reason`
the caller handles itself (`final`: a reward API that failed a batch is the worker's to count and
drop, not a server to wait for). Anything else is the caller's to handle: INVALID_ARGUMENT is a
bug in the request and never gets better by repeating it. Only unary calls are intercepted.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterable

import grpc

from .errors import Reason, reason_of

if TYPE_CHECKING:
    from ..config_sections import RPCConfig

log = logging.getLogger(__name__)

RETRY_ALWAYS = frozenset({grpc.StatusCode.UNAVAILABLE})
RETRY_IF_IDEMPOTENT = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED})
# the methods (gRPC's names) that only read, or whose repeat is harmless
IDEMPOTENT = frozenset({"Values", "Score", "Generate", "GetInfo", "Info", "Save", "Load"})


class DependencyUnavailable(RuntimeError):
    """A service stayed unavailable longer than the caller waits (or the caller is stopping)."""


def backoff_delays(initial_s: float, max_s: float):
    """initial, 2 x initial, 4 x initial, ... capped at max_s, forever."""
    d = initial_s
    while True:
        yield min(d, max_s)
        d *= 2


def _method(details: grpc.ClientCallDetails) -> str:
    """ "/rlhf.v1.Critic/Values" -> "Values"."""
    method = details.method
    return (method.decode() if isinstance(method, bytes) else method).rsplit("/", 1)[-1]


def _failure(outcome) -> grpc.RpcError | None:
    """The error a unary call's outcome holds (None when it was answered); it waits for it."""
    error = outcome.exception()
    return error if isinstance(error, grpc.RpcError) else None


class RideThrough(grpc.UnaryUnaryClientInterceptor):
    """Each unary call repeated while its service is unavailable, for up to `wait_s` seconds
    (None = forever; default rpc.dependency_wait_s) or until `stop_event` is set, then
    `DependencyUnavailable`. `on_wait(msg)` is told what it waits for (None once it is answered
    again). `what` and `address` name the service in what it says."""

    def __init__(
        self,
        what: str,
        address: str,
        rpc_cfg: RPCConfig,
        stop_event: threading.Event | None = None,
        on_wait: Callable[[str | None], None] | None = None,
        wait_s: float | None = -1,
        idempotent: Iterable[str] = IDEMPOTENT,
        final: Iterable[Reason] = (),
    ):
        self.what, self.address = what, address
        self.initial_s, self.max_s = rpc_cfg.retry_backoff_s, rpc_cfg.retry_max_backoff_s
        self.wait_s = rpc_cfg.dependency_wait_s if wait_s == -1 else wait_s
        self.stop_event = stop_event or threading.Event()
        self.on_wait = on_wait or (lambda msg: None)
        self.idempotent, self.final = frozenset(idempotent), frozenset(final)

    def repeats(self, e: grpc.RpcError, method: str) -> bool:
        code = e.code()
        if not (code in RETRY_ALWAYS or (method in self.idempotent and code in RETRY_IF_IDEMPOTENT)):
            return False
        return not self.final or reason_of(e) not in self.final

    def intercept_unary_unary(self, continuation, client_call_details, request):
        method = _method(client_call_details)
        delays = backoff_delays(self.initial_s, self.max_s)
        t0, waited, last_log = time.monotonic(), False, 0.0
        while True:
            outcome = continuation(client_call_details, request)
            e = _failure(outcome)
            if e is None or not self.repeats(e, method):
                if waited:
                    if e is None:
                        log.info("%s at %s answers again after %.1fs", self.what, self.address, time.monotonic() - t0)
                    self.on_wait(None)
                return outcome
            elapsed = time.monotonic() - t0
            details = e.details() or ""
            why = f"{e.code().name}: {details.splitlines()[0][:200] if details else ''}"
            if self.stop_event.is_set() or (self.wait_s is not None and elapsed >= self.wait_s):
                raise DependencyUnavailable(
                    f"the {self.what} at {self.address} did not answer {method} "
                    f"({why}) for {elapsed:.0f}s" + ("; stopping" if self.stop_event.is_set() else "")
                ) from None
            msg = f"waiting for the {self.what} at {self.address} ({why})"
            waited = True
            self.on_wait(msg)
            if time.monotonic() - last_log > 10:
                last_log = time.monotonic()
                log.warning("%s; retrying %s for %.0fs so far", msg, method, elapsed)
            self.stop_event.wait(next(delays))


class Tagged(grpc.UnaryUnaryClientInterceptor):
    """A failed call's error names its service: `e.service`."""

    def __init__(self, service: str):
        self.service = service

    def intercept_unary_unary(self, continuation, client_call_details, request):
        outcome = continuation(client_call_details, request)
        e = _failure(outcome)
        if e is not None:
            e.service = self.service  # type: ignore[attr-defined]
        return outcome


class EachAnswer(grpc.UnaryUnaryClientInterceptor):
    """`callback()` after every unary call, answered or failed (a caller that waits on another
    service shows progress with each answer)."""

    def __init__(self, callback: Callable[[], None]):
        self.callback = callback

    def intercept_unary_unary(self, continuation, client_call_details, request):
        try:
            outcome = continuation(client_call_details, request)
            outcome.exception()  # the answer (or the failure) has come
            return outcome
        finally:
            self.callback()
