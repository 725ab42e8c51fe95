"""An external reward API over HTTP, in OpenRLHF's remote reward-model protocol:

    POST {"query": [prompt+response, ...], "prompts": [...], "labels": [...]}
    ->   {"rewards": [r, ...]}      (r a number, or a list whose sum is the reward; extra keys ignored)

Batches are split into requests of `batch_size`, sent by one pool of `concurrency` threads per
scorer, so that many requests at most are in flight however many Score calls run at once. A
sample whose reward could not be had is an error, never a number (no default, no 0), and a batch
is scored whole or not at all. What happens to a request, by the API's answer:

    timeout, connection refused or closed, 5xx, 429
        -> retried (`retries` times) after a backoff with decorrelated jitter (each wait drawn
           between `backoff_s` and 3 x the last, at most `max_backoff_s`), or after the
           `Retry-After` of a 429 or 503 (seconds or an HTTP date, at most `retry_after_max_s`);
           all failed: `RewardAPIFailed` (gRPC UNAVAILABLE, details starting "reward API failed")
    an answer that is not one finite reward per sample -> `RewardAPIFailed` at once
    401, 403, 404, 405, 407 (the API refuses us: a token or URL to fix)
        -> `RewardUnavailable` at once (UNAVAILABLE: callers wait, as for a server restarting)
    any other 4xx (the API judged this input) -> `RewardRejected` at once (INVALID_ARGUMENT),
           with the status and the start of the body

A circuit breaker (breaker.py) watches the requests: after `breaker_failures` failed ones in a row (anything
but an answer with rewards or a 4xx about the input) it opens for `breaker_cooldown_s`: calls
fail at once with `RewardUnavailable` ("circuit open") without reaching the API; then one probe
request goes through (half-open) and its success closes the breaker, its failure opens it again.
Each change is logged once (WARNING on open, INFO on close) and shown by `status()` and the
`rlhf_reward_api_breaker_*` metrics. A failure that may be the input's (a timeout or a closed
connection after connecting, a 500/502/504, an answer that is not rewards) counts once per
distinct request body, however often that body is retried: one input the API chokes on cannot
open the breaker for everyone (its group is dropped instead); failures that are never the
input's (no connection, 429, 503, 401/403/404/405/407) count every time.

The auth header (`reward.http_auth_*`: a token read from an environment variable) goes with every
request; its value is cut out of every message, log line and status this module writes.
"""

from __future__ import annotations

import email.utils
import json
import logging
import math
import os
import random
import threading
import time
from concurrent.futures import CancelledError, ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Sequence
from urllib.parse import urlsplit, urlunsplit

import httpx

from ..common.rpc.errors import BadRequest, Reason
from ..common.types import RewardSample, ScoreResult
from .breaker import CircuitBreaker, RewardUnavailable

if TYPE_CHECKING:
    from ..common.config_sections import RewardConfig

log = logging.getLogger(__name__)

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


def _to_float(x, i: int) -> float:
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


def public_url(url: str) -> str:
    """`url` without credentials or query (what logs, errors and /status show)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        netloc = host + (f":{parts.port}" if parts.port else "")
        return urlunsplit((parts.scheme, netloc, parts.path, "", ""))
    except ValueError:
        return "<reward API>"


class HTTPScorer:
    """`metrics` (a `RewardAPIMetrics`) counts every request by outcome and times it, and shows
    the breaker. `headers` go with every request; their values never appear in a message."""

    def __init__(
        self,
        url: str,
        timeout_s: float = 30.0,
        retries: int = 3,
        concurrency: int = 8,
        batch_size: int = 64,
        backoff_s: float = 0.5,
        headers: dict | None = None,
        metrics=None,
        max_backoff_s: float = 10.0,
        retry_after_max_s: float = 60.0,
        breaker_failures: int = 5,
        breaker_cooldown_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.url, self.retries, self.batch_size, self.backoff_s = url, retries, batch_size, backoff_s
        self.max_backoff_s, self.retry_after_max_s = max(max_backoff_s, backoff_s), retry_after_max_s
        self.public_url = public_url(url)
        headers = dict(headers or {})
        secrets = {v for v in headers.values()} | {v.split(None, 1)[-1] for v in headers.values() if v.strip()}
        self._secrets = sorted((s for s in secrets if s.strip()), key=len, reverse=True)  # the token after "Bearer"
        self.metrics = metrics
        if metrics is not None:
            metrics.expect_calls()
        self.breaker = CircuitBreaker(
            breaker_failures,
            breaker_cooldown_s,
            f"reward API {self.public_url}",
            on_change=self._breaker_changed,
            redact=self.redact,
            clock=clock,
        )
        self.client = httpx.Client(timeout=timeout_s, headers=headers, limits=httpx.Limits(max_connections=concurrency))
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="reward-http")
        self._rng = random.Random()

    @classmethod
    def from_config(cls, reward_cfg: RewardConfig, metrics=None) -> "HTTPScorer":
        if not reward_cfg.http_url:
            raise ValueError("reward.http_url is not set: the URL of your reward API")
        return cls(
            reward_cfg.http_url,
            reward_cfg.http_timeout_s,
            reward_cfg.http_retries,
            reward_cfg.http_concurrency,
            backoff_s=reward_cfg.http_backoff_s,
            max_backoff_s=reward_cfg.http_max_backoff_s,
            retry_after_max_s=reward_cfg.http_retry_after_max_s,
            headers=auth_headers(reward_cfg),
            breaker_failures=reward_cfg.http_breaker_failures,
            breaker_cooldown_s=reward_cfg.http_breaker_cooldown_s,
            metrics=metrics,
        )

    def redact(self, text: str) -> str:
        for s in self._secrets:
            text = text.replace(s, "***")
        return text

    def _breaker_changed(self, state: str, opened: bool) -> None:
        if self.metrics is not None:
            self.metrics.breaker(state, opened)

    def _record(self, outcome: str, t0: float) -> None:
        if self.metrics is not None:
            self.metrics.record(outcome, time.perf_counter() - t0)

    def _post(self, chunk: Sequence[RewardSample], abort: threading.Event | None = None) -> list[float]:
        """The rewards of `chunk` (one request, retried). `abort` is set when a request of the same
        call failed: then this one is not sent (again)."""
        try:
            return self._attempts(chunk, abort or threading.Event())
        except Exception:
            if abort is not None:
                abort.set()
            raise

    def _attempts(self, chunk: Sequence[RewardSample], abort: threading.Event) -> list[float]:
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
            try:
                self.breaker.allow()
            except RewardUnavailable:
                if self.metrics is not None:
                    self.metrics.refused()
                raise
            t0 = time.perf_counter()
            wait = None  # the Retry-After of this answer, if it asks for one
            try:
                r = self.client.post(self.url, content=body, headers=JSON)
            except httpx.TransportError as e:  # timeouts, refused or closed connections
                self._record("transport_error", t0)
                unreachable = True
                last_error = self.redact(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
                self.breaker.failure(last_error, None if isinstance(e, UNREACHABLE) else key)
            else:
                code, unreachable = r.status_code, False
                if code >= 500 or code == 429:
                    self._record("http_error", t0)
                    last_error = f"HTTP {code}"
                    if code in (429, 503):
                        wait = retry_after_s(r.headers.get("retry-after"))
                        if wait is not None:
                            last_error += f" (Retry-After {r.headers.get('retry-after')[:40]})"
                    self.breaker.failure(last_error, None if code in (429, 503) else key)
                elif code >= 400:
                    self._record("http_error", t0)
                    snippet = " ".join(self.redact(r.text[:4000]).split())[:200]  # redacted before it is cut
                    if code in REFUSES_US:
                        self.breaker.failure(f"HTTP {code}")
                        raise RewardUnavailable(
                            f"reward API {self.public_url} refuses the request: HTTP {code} "
                            f"{snippet} (check reward.http_url and the token in "
                            f"reward.http_auth_env)"
                        )
                    self.breaker.success()  # it is up, and judged this input
                    raise RewardRejected(f"reward API {self.public_url} rejected the request: HTTP {code} {snippet}")
                else:
                    try:
                        values = self._rewards(r, len(chunk))
                    except ValueError as e:
                        self._record("bad_answer", t0)
                        msg = self.redact(f"{self.public_url} answered {e}")
                        self.breaker.failure(msg, key)
                        raise RewardAPIFailed(msg) from None
                    self._record("ok", t0)
                    self.breaker.success()
                    return values
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

    def _gave_up(self, last_error: str, unreachable: bool) -> str:
        """Why a request got no reward after its attempts, and what to check."""
        attempts = f"{self.retries + 1} attempt{'s' if self.retries else ''}"
        check = (
            "check that it is running and reachable at that URL (reward.http_url)" if unreachable else "check its log"
        )
        return f"{self.public_url} gave no reward after {attempts} ({last_error}); {check}"

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
        return [_to_float(x, i) for i, x in enumerate(rewards)]

    def score(self, samples: Sequence[RewardSample]) -> list[ScoreResult]:
        """A reward for every sample, or an exception: never a part of the batch. After the first
        request that fails, the batch's requests not yet sent are not sent."""
        chunks = [samples[i : i + self.batch_size] for i in range(0, len(samples), self.batch_size)]
        abort = threading.Event()
        futures = [self.pool.submit(self._post, c, abort) for c in chunks]
        out: list[ScoreResult] = []
        errors: list[Exception] = []
        for f in futures:
            try:
                rewards = f.result()
            except CancelledError:
                continue
            except (RewardUnavailable, RewardRejected) as e:
                errors.append(e)
                for g in futures:
                    g.cancel()
                continue
            out.extend(ScoreResult(r, {"http": r}) for r in rewards)
        if not errors and len(out) == len(samples):
            return out
        if not errors:  # cannot happen: a request is only skipped after another failed
            raise RewardAPIFailed(f"{len(out)} rewards for {len(samples)} samples")
        # the API down or refusing us (callers wait) before an input it rejects (isolated) before a
        # failed batch (scored again, then dropped)
        down = self.breaker.open_error()
        if down is not None and not any(type(e) is RewardUnavailable for e in errors):
            errors.insert(0, down)
        for kind in (RewardUnavailable, RewardRejected, RewardAPIFailed):
            for error in errors:
                if type(error) is kind:
                    raise error
        raise errors[0]

    def status(self) -> dict:
        """The API's URL (without credentials) and its breaker: what /status shows."""
        return {"url": self.public_url, "breaker": self.breaker.status()}


def auth_headers(reward_cfg: RewardConfig) -> dict:
    """{`reward.http_auth_header`: "`http_auth_scheme` token"} when the environment variable
    `reward.http_auth_env` holds a token; {} otherwise."""
    token = os.environ.get(reward_cfg.http_auth_env, "").strip() if reward_cfg.http_auth_env else ""
    if not token:
        return {}
    scheme = (reward_cfg.http_auth_scheme or "").strip()
    return {reward_cfg.http_auth_header: f"{scheme} {token}" if scheme else token}


def api_scorers(scorer) -> list[HTTPScorer]:
    """The `HTTPScorer`s in `scorer` (itself, or the parts of a `CombinedScorer`)."""
    if isinstance(scorer, HTTPScorer):
        return [scorer]
    return [s for _, _, s in getattr(scorer, "parts", ()) if isinstance(s, HTTPScorer)]
