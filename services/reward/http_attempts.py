"""One request to the user's reward API, attempted until its answer holds rewards or it gives up:
the retry policy of `HTTPScorer` (http_scorer.py says what happens on each answer).

An attempt asks the circuit breaker first (breaker.py), posts the body, and tells the breaker
what came of it: a failure that may be the input's counts under the body's key (once per distinct
body), one that never is counts every time. Timeouts, lost connections, 5xx and 429 are tried
again after a decorrelated-jitter backoff or the answer's `Retry-After`; an answer that is not
one finite reward per sample fails the request at once, and so does a 4xx (refusing us, or
rejecting the input). Its log lines are the scorer's (`services.reward.http_scorer`)."""

from __future__ import annotations

import email.utils
import json
import logging
import math
import random
import threading
import time
from concurrent.futures import CancelledError
from typing import Callable, NamedTuple, Sequence

import httpx

from ..common.rpc.errors import BadRequest, Reason
from ..common.types import RewardSample
from .breaker import CircuitBreaker, RewardUnavailable

log = logging.getLogger("services.reward.http_scorer")  # its lines read as the scorer's, as before

REFUSES_US = frozenset({401, 403, 404, 405, 407})  # a credential or URL problem, not this input's
UNREACHABLE = (httpx.ConnectError, httpx.ConnectTimeout)  # never the input's fault
JSON = {"Content-Type": "application/json"}


class RewardAPIFailed(RewardUnavailable):
    """The API failed this batch: every attempt of a request timed out, lost its connection or got
    5xx/429, or its answer was not rewards. UNAVAILABLE with `Reason.REWARD_API_FAILED`: a
    rollout worker scores the batch again a few times, then drops its groups (and counts them)."""

    def __init__(self, message: str):
        super().__init__(f"reward API failed: {message}", Reason.REWARD_API_FAILED)


class RewardRejected(BadRequest):
    """The API answered 4xx about this input (400, 413, 422, ...): INVALID_ARGUMENT, never retried
    (a worker isolates the prompt that causes it and dead-letters it)."""


def to_float(x, i: int) -> float:
    """Sample `i`'s reward in an answer: a finite number, or a non-empty list whose sum is one."""
    if isinstance(x, (list, tuple)):
        if not x:
            raise ValueError(f"an empty list for sample {i}")
        x = sum(float(v) for v in x)
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ValueError(f"{x!r} for sample {i}, not a number")
    v = float(x)
    if not math.isfinite(v):
        raise ValueError(f"{v} for sample {i}")
    return v


def retry_after_s(value: str | None, now: float | None = None) -> float | None:
    """Seconds a `Retry-After` header asks to wait (a number of seconds, or an HTTP date); None
    when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def decorrelated_jitter(rng: random.Random, base_s: float, cap_s: float, last_s: float) -> float:
    """The wait before the next retry: drawn between `base_s` and 3 x the last wait, at most `cap_s`
    (spreads the retries of many callers; grows about threefold while they keep failing)."""
    return min(cap_s, rng.uniform(base_s, 3 * last_s))


class Failed(NamedTuple):
    """An attempt that may be tried again: why it failed (redacted), the `Retry-After` its answer
    asked for (None: back off), whether the API could not be reached at all."""

    error: str
    wait: float | None
    unreachable: bool


class HTTPAttempts:
    """Sends one request body to `url` through `client` (`retries` more attempts after the first)
    under `breaker`. `redact` cuts the auth token out of every message; `metrics` (a
    `RewardAPIMetrics`, or None) counts every request by outcome and times it."""

    def __init__(
        self,
        url: str,
        public_url: str,
        client: httpx.Client,
        breaker: CircuitBreaker,
        redact: Callable[[str], str],
        metrics=None,
        retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        retry_after_max_s: float = 60.0,
    ):
        self.url, self.public_url, self.client, self.breaker = url, public_url, client, breaker
        self.redact, self.metrics, self.retries, self.backoff_s = redact, metrics, retries, backoff_s
        self.max_backoff_s, self.retry_after_max_s = max(max_backoff_s, backoff_s), retry_after_max_s
        self._rng = random.Random()

    def rewards(self, chunk: Sequence[RewardSample], abort: threading.Event) -> list[float]:
        """The rewards of `chunk` (one request, retried); `CancelledError` once `abort` is set."""
        body = json.dumps(
            {
                "query": [s.prompt + s.response for s in chunk],
                "prompts": [s.prompt for s in chunk],
                "labels": [s.label for s in chunk],
            },
            ensure_ascii=False,
        ).encode()
        key = hash(body)  # the breaker counts a body's failures that may be its own once
        last_error, delay, unreachable = "no attempt", self.backoff_s, False
        for attempt in range(self.retries + 1):
            if abort.is_set():
                raise CancelledError()
            self._allow()
            outcome = self._attempt(body, len(chunk), key)
            if not isinstance(outcome, Failed):
                return outcome
            last_error, wait, unreachable = outcome
            if attempt == self.retries:
                break
            if wait is not None:
                pause = min(wait, self.retry_after_max_s)
            else:
                pause = delay = decorrelated_jitter(self._rng, self.backoff_s, self.max_backoff_s, delay)
            log.info(
                "reward API %s attempt %d/%d failed (%s); retrying in %.2fs",
                self.public_url,
                attempt + 1,
                self.retries + 1,
                last_error,
                pause,
            )
            time.sleep(pause)
        raise RewardAPIFailed(self._gave_up(last_error, unreachable))

    def _allow(self) -> None:
        """The breaker's leave to send (`RewardUnavailable` while it is open, counted as refused)."""
        try:
            self.breaker.allow()
        except RewardUnavailable:
            if self.metrics is not None:
                self.metrics.refused()
            raise

    def _record(self, outcome: str, t0: float) -> None:
        if self.metrics is not None:
            self.metrics.record(outcome, time.perf_counter() - t0)

    def _attempt(self, body: bytes, n: int, key: int) -> list[float] | Failed:
        """One post of `body`: its `n` rewards, a failure worth another attempt, or an error raised."""
        t0 = time.perf_counter()
        try:
            r = self.client.post(self.url, content=body, headers=JSON)
        except httpx.TransportError as e:  # timeouts, refused or closed connections
            self._record("transport_error", t0)
            last_error = self.redact(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
            self.breaker.failure(last_error, None if isinstance(e, UNREACHABLE) else key)
            return Failed(last_error, None, True)
        code = r.status_code
        if code >= 500 or code == 429:
            self._record("http_error", t0)
            last_error = f"HTTP {code}"
            wait = None  # the Retry-After of this answer, if it asks for one
            if code in (429, 503):
                wait = retry_after_s(r.headers.get("retry-after"))
                if wait is not None:
                    last_error += f" (Retry-After {r.headers.get('retry-after')[:40]})"
            self.breaker.failure(last_error, None if code in (429, 503) else key)
            return Failed(last_error, wait, False)
        if code >= 400:
            self._record("http_error", t0)
            raise self._refused(r, code)
        return self._answered(r, n, key, t0)

    def _refused(self, r: httpx.Response, code: int) -> Exception:
        """The error of a 4xx answer: the API refuses us (a token or URL to fix), or rejects this input."""
        snippet = " ".join(self.redact(r.text[:4000]).split())[:200]  # redacted before it is cut
        if code in REFUSES_US:
            self.breaker.failure(f"HTTP {code}")
            return RewardUnavailable(
                f"reward API {self.public_url} refuses the request: HTTP {code} "
                f"{snippet} (check reward.http_url and the token in "
                f"reward.http_auth_env)"
            )
        self.breaker.success()  # it is up, and judged this input
        return RewardRejected(f"reward API {self.public_url} rejected the request: HTTP {code} {snippet}")

    def _answered(self, r: httpx.Response, n: int, key: int, t0: float) -> list[float]:
        """The rewards of a 2xx/3xx answer, or `RewardAPIFailed` when it holds no `n` rewards."""
        try:
            values = self._rewards(r, n)
        except ValueError as e:
            self._record("bad_answer", t0)
            msg = self.redact(f"{self.public_url} answered {e}")
            self.breaker.failure(msg, key)
            raise RewardAPIFailed(msg) from None
        self._record("ok", t0)
        self.breaker.success()
        return values

    def _rewards(self, r: httpx.Response, n: int) -> list[float]:
        try:
            answer = r.json()
        except ValueError:
            body = self.redact(r.text[:4000])[:100]  # redacted before it is cut
            raise ValueError(f"HTTP {r.status_code} with a body that is not JSON: {body!r}") from None
        rewards = answer.get("rewards") if isinstance(answer, dict) else None
        if isinstance(rewards, (int, float)) and not isinstance(rewards, bool) and n == 1:
            rewards = [rewards]
        if not isinstance(rewards, list) or len(rewards) != n:
            raise ValueError(
                f"{len(rewards) if isinstance(rewards, list) else repr(rewards)[:100]} rewards for {n} samples"
            )
        return [to_float(x, i) for i, x in enumerate(rewards)]

    def _gave_up(self, last_error: str, unreachable: bool) -> str:
        """Why a request got no reward after its attempts, and what to check."""
        attempts = f"{self.retries + 1} attempt{'s' if self.retries else ''}"
        check = (
            "check that it is running and reachable at that URL (reward.http_url)" if unreachable else "check its log"
        )
        return f"{self.public_url} gave no reward after {attempts} ({last_error}); {check}"
