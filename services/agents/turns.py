"""Which generation server samples a session's turn (`TurnSampler`): the session's own while it
answers (its prefix cache stays warm), else another, each tried once (common/servers.py: `Tries`
under a `RetryPolicy`); and whether any answers at all (`unavailable`, what /health reports)."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Callable

import grpc

from ..common.rpc.client import Cancel
from ..common.rpc.errors import Reason, reason_of
from ..common.servers import Fault, RetryPolicy, Tries
from ..common.types import SamplingParams
from .protocol import EndpointError
from .sessions import Session

log = logging.getLogger(__name__)

AVOID_S = 10.0  # a generation server that failed a call is left out this long
HEALTH_CACHE_S = 1.0  # /health asks a generation server at most this often


class TurnSampler:
    """Generate calls for sessions: each session's requests go to one generation server while it
    answers (its prefix cache stays warm); one that fails is avoided for a while and the call goes
    to another, each server tried once (`RETRY`). `servers`: the pool of generation servers
    (common/servers.py:ServerPool)."""

    RETRY = RetryPolicy(avoid_s=AVOID_S, each_once=True)

    def __init__(self, servers, timeout_s: float | Callable[[], float]):
        """`timeout_s`: a call's deadline, or what gives it at each call."""
        self.servers = servers
        self.timeout_s = timeout_s if callable(timeout_s) else (lambda: float(timeout_s))
        self._health: tuple[float, str | None] = (-HEALTH_CACHE_S, None)
        self._health_lock = threading.Lock()

    def generate(
        self, session: Session, prompt: list[int], params: SamplingParams, first: int, cancel: Cancel | None = None
    ):
        """`first`: how many of `prompt`'s tokens are its conversation's first prompt; `cancel`:
        set when the turn's client hangs up (the call is cancelled: `Abandoned`, no other server
        is tried)."""
        key = uuid.uuid4().hex  # one request: a retry on the same server joins its work
        for asked in (False, True):
            # the session's server first, else a new one at the session's policy version if one is
            tries = Tries(self.servers, self.RETRY, session.min_version, first=session.server)
            for address in tries:
                if address is None:
                    break
                result = self._call(address, session, tries, [prompt], params, key, first, cancel)
                if result is not None:
                    return result
            # every server avoided after an earlier failure: one that answers now is let back
            # (as /health finds it), so a restarted server serves as soon as /health says so
            if asked or tries.tried or self.unavailable() is not None:
                break
        raise EndpointError(503, "no generation server is available", "service_unavailable", "no_generation_server")

    def _call(self, address: str, session: Session, tries: Tries, prompts, params, key, first, cancel):
        """One try on `address`: its result, or None when the server failed (avoided now)."""
        try:
            result = self.servers.client(address).generate(
                prompts, params, timeout=self.timeout_s(), key=key, first_prompt_tokens=[first], cancel=cancel
            )
        except ValueError as e:  # a value the wire cannot carry (the request's checks let none through)
            raise EndpointError(400, f"the request: {e}") from None
        except grpc.RpcError as e:
            refused(e)
            log.warning("generation server %s failed (%s); the session goes on on another", address, e.code().name)
            tries.failed(address, Fault.FAILED)
            session.server = None
            return None
        session.server = address
        return result

    def unavailable(self) -> str | None:
        """Why the endpoint cannot sample now (no generation server is listed, or none of them
        answers GetInfo within a second), or None when it can: then the server that answered is
        one turns may go to at once (`ServerPool.restore`: /health says 200 only when a turn would
        be served). Asked at most once a second."""
        with self._health_lock:
            at, why = self._health
            if time.monotonic() - at < HEALTH_CACHE_S:
                return why
            why = self._reachable()
            self._health = (time.monotonic(), why)
            return why

    def _reachable(self) -> str | None:
        servers = self.servers
        try:
            live = sorted(servers.live())
        except Exception as e:  # the registry (Redis) did not answer
            return f"the registry of generation servers did not answer: {type(e).__name__}"
        if not live:
            return "no generation server is registered"
        for address in live:
            try:
                servers.client(address).info(timeout=1.0)
            except Exception:
                continue
            servers.restore(address)
            return None
        return f"none of the {len(live)} generation servers answers"


def refused(e: grpc.RpcError) -> None:
    """A failed Generate that no other server mends, as the endpoint's answer: the request refused
    (400), or the server full (429)."""
    if reason_of(e) is Reason.PROMPT_INVALID or e.code() == grpc.StatusCode.INVALID_ARGUMENT:
        raise EndpointError(400, f"the request: {e.details()}") from None
    if reason_of(e) is Reason.REQUEST_TOO_LARGE:  # it can never fit: not a "full" to retry
        raise EndpointError(400, f"the request: {e.details()}", code="request_too_large", param="n") from None
    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        raise EndpointError(
            429, f"the generation server is full: {e.details()}", "rate_limit_error", "server_full"
        ) from None
