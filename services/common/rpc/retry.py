"""Riding through a restart: a client wrapper that retries calls which found their service
unavailable (a server restarting, a connection refused) with exponential backoff, for as long as
the caller is willing to wait, and says what it waits for.

    critic = Retrying(CriticClient(addr, cfg.rpc), "critic", cfg.rpc, stop_event, on_wait=set_state)
    critic.values(batch)      # UNAVAILABLE -> wait 0.2 s, 0.4 s, ... (at most rpc.retry_max_backoff_s)

Retried: UNAVAILABLE for every method (the call did not reach a live server, or the server went
away; a restarted server comes back to a defined state, so a repeat is safe), and
DEADLINE_EXCEEDED for methods that only read (`idempotent`). Anything else is the caller's to
handle: INVALID_ARGUMENT is a bug in the request and never gets better by repeating it.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterable

import grpc

if TYPE_CHECKING:
    from ..config_sections import RPCConfig

log = logging.getLogger(__name__)

RETRY_ALWAYS = frozenset({grpc.StatusCode.UNAVAILABLE})
RETRY_IF_IDEMPOTENT = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED})


class DependencyUnavailable(RuntimeError):
    """A service stayed unavailable longer than the caller waits (or the caller is stopping)."""


def backoff_delays(initial_s: float, max_s: float):
    """initial, 2 x initial, 4 x initial, ... capped at max_s, forever."""
    d = initial_s
    while True:
        yield min(d, max_s)
        d *= 2


def retryable(e: BaseException, idempotent: bool) -> bool:
    if not isinstance(e, grpc.RpcError) or not hasattr(e, "code"):
        return False
    code = e.code()
    return code in RETRY_ALWAYS or (idempotent and code in RETRY_IF_IDEMPOTENT)


class Retrying:
    """Proxy of a gRPC client (`CriticClient`, `RewardClient`, `GenerationClient`): each method
    call is retried while its service is unavailable, for up to `wait_s` seconds (None =
    forever) or until `stop_event` is set, then raises `DependencyUnavailable`. `on_wait(msg)`
    is told what it waits for (None once it is answered again)."""

    def __init__(self, client, what: str, rpc_cfg: RPCConfig, stop_event: threading.Event | None = None,
                 on_wait: Callable[[str | None], None] | None = None, wait_s: float | None = -1,
                 idempotent: Iterable[str] = ("values", "score", "generate", "info", "save", "load", "version")):
        self.client, self.what = client, what
        self.initial_s, self.max_s = rpc_cfg.retry_backoff_s, rpc_cfg.retry_max_backoff_s
        self.wait_s = rpc_cfg.dependency_wait_s if wait_s == -1 else wait_s
        self.stop_event = stop_event or threading.Event()
        self.on_wait = on_wait or (lambda msg: None)
        self.idempotent = frozenset(idempotent)

    def call(self, name: str, *args, **kwargs):
        fn = getattr(self.client, name)
        delays = backoff_delays(self.initial_s, self.max_s)
        t0, waited, last_log = time.monotonic(), False, 0.0
        while True:
            try:
                out = fn(*args, **kwargs)
                if waited:
                    log.info("%s at %s answers again after %.1fs", self.what, self.address, time.monotonic() - t0)
                    self.on_wait(None)
                return out
            except grpc.RpcError as e:
                if not retryable(e, name in self.idempotent):
                    raise
                elapsed = time.monotonic() - t0
                why = f"{e.code().name}: {(e.details() or '').splitlines()[0][:200] if e.details() else ''}"
                if self.stop_event.is_set() or (self.wait_s is not None and elapsed >= self.wait_s):
                    raise DependencyUnavailable(
                        f"the {self.what} at {self.address} did not answer {name} "
                        f"({why}) for {elapsed:.0f}s" + ("; stopping" if self.stop_event.is_set() else "")) from None
                msg = f"waiting for the {self.what} at {self.address} ({why})"
                waited = True
                self.on_wait(msg)
                if time.monotonic() - last_log > 10:
                    last_log = time.monotonic()
                    log.warning("%s; retrying %s for %.0fs so far", msg, name, elapsed)
                self.stop_event.wait(next(delays))

    @property
    def address(self) -> str:
        return getattr(self.client, "address", "?")

    def __getattr__(self, name):
        attr = getattr(self.client, name)
        if not callable(attr) or name.startswith("_") or name in ("close",):
            return attr
        return lambda *a, **k: self.call(name, *a, **k)
