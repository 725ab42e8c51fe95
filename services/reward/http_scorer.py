"""An external reward API over HTTP, in OpenRLHF's remote reward-model protocol:

    POST {"query": [prompt+response, ...], "prompts": [...], "labels": [...]}
    ->   {"rewards": [r, ...]}      (r a number, or a list whose sum is the reward; extra keys ignored)

Batches are split into requests of `batch_size`, sent by one pool of `concurrency` threads per
scorer, so that many requests at most are in flight however many Score calls run at once. A
sample whose reward could not be had is an error, never a number (no default, no 0), and a batch
is scored whole or not at all. What happens to a request (its attempts: `HTTPAttempts`,
http_attempts.py), by the API's answer:

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

import os
import threading
import time
from concurrent.futures import CancelledError, ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Sequence
from urllib.parse import urlsplit, urlunsplit

import httpx

from ..common.types import RewardSample, ScoreResult
from .breaker import CircuitBreaker, RewardUnavailable
from .http_attempts import HTTPAttempts, RewardAPIFailed, RewardRejected, decorrelated_jitter, retry_after_s

if TYPE_CHECKING:
    from ..common.config_sections import RewardConfig

# the names importers take from here (the errors and the retry helpers live in http_attempts.py)
__all__ = [
    "HTTPScorer",
    "RewardAPIFailed",
    "RewardRejected",
    "RewardUnavailable",
    "api_scorers",
    "auth_headers",
    "decorrelated_jitter",
    "public_url",
    "retry_after_s",
]


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
        self.url, self.batch_size = url, batch_size
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
        client = httpx.Client(timeout=timeout_s, headers=headers, limits=httpx.Limits(max_connections=concurrency))
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="reward-http")
        self.attempts = HTTPAttempts(
            url,
            self.public_url,
            client,
            self.breaker,
            self.redact,
            metrics,
            retries=retries,
            backoff_s=backoff_s,
            max_backoff_s=max_backoff_s,
            retry_after_max_s=retry_after_max_s,
        )

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

    @property
    def client(self) -> httpx.Client:
        """The HTTP client every request goes through (its connections, timeout and headers)."""
        return self.attempts.client

    @client.setter
    def client(self, client: httpx.Client) -> None:
        self.attempts.client = client

    def redact(self, text: str) -> str:
        for s in self._secrets:
            text = text.replace(s, "***")
        return text

    def _breaker_changed(self, state: str, opened: bool) -> None:
        if self.metrics is not None:
            self.metrics.breaker(state, opened)

    def _post(self, chunk: Sequence[RewardSample], abort: threading.Event | None = None) -> list[float]:
        """The rewards of `chunk` (one request, retried: `HTTPAttempts`). `abort` is set when a
        request of the same call failed: then this one is not sent (again)."""
        try:
            return self.attempts.rewards(chunk, abort or threading.Event())
        except Exception:
            if abort is not None:
                abort.set()
            raise

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
