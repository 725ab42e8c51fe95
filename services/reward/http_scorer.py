"""An external reward API over HTTP, in OpenRLHF's remote reward-model protocol:

    POST {"query": [prompt+response, ...], "prompts": [...], "labels": [...]}
    ->   {"rewards": [r, ...]}      (r a number, or a list whose sum is the reward; extra keys ignored)

Batches are split into requests of `batch_size`, sent at most `concurrency` at a time, each
with a timeout and retries with exponential backoff. A sample whose reward could not be had is
an error (`RewardUnavailable`), never a silent 0.
"""
from __future__ import annotations

import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import httpx

from ..common.rpc.errors import Unavailable
from ..common.types import RewardSample, ScoreResult

log = logging.getLogger(__name__)


class RewardUnavailable(Unavailable):
    pass


def _to_float(x, i: int) -> float:
    if isinstance(x, (list, tuple)):
        if not x:
            raise RewardUnavailable(f"reward API returned an empty list for sample {i}")
        x = sum(float(v) for v in x)
    v = float(x)
    if not math.isfinite(v):
        raise RewardUnavailable(f"reward API returned {v} for sample {i}")
    return v


class HTTPScorer:
    """`metrics` (a `RewardAPIMetrics`) counts every request by outcome and times it."""

    def __init__(self, url: str, timeout_s: float = 30.0, retries: int = 3, concurrency: int = 8,
                 batch_size: int = 64, backoff_s: float = 0.5, headers: dict | None = None, metrics=None):
        self.url, self.retries, self.batch_size, self.backoff_s = url, retries, batch_size, backoff_s
        self.metrics = metrics
        if metrics is not None:
            metrics.expect_calls()
        self.client = httpx.Client(timeout=timeout_s, headers=headers or {},
                                   limits=httpx.Limits(max_connections=concurrency))
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="reward-http")

    @classmethod
    def from_config(cls, reward_cfg, metrics=None) -> "HTTPScorer":
        return cls(reward_cfg.http_url, reward_cfg.http_timeout_s, reward_cfg.http_retries, reward_cfg.http_concurrency,
                   metrics=metrics)

    def _post(self, chunk: Sequence[RewardSample]) -> list[float]:
        body = {"query": [s.prompt + s.response for s in chunk], "prompts": [s.prompt for s in chunk],
                "labels": [s.label for s in chunk]}
        last_error = "no attempt"
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            outcome, t0 = "transport_error", time.perf_counter()
            try:
                r = self.client.post(self.url, json=body)
                if r.status_code >= 500 or r.status_code == 429:
                    outcome, last_error = "http_error", f"HTTP {r.status_code}"
                    continue
                if r.status_code >= 400:
                    outcome = "http_error"
                    raise RewardUnavailable(f"reward API {self.url} refused the request: HTTP {r.status_code} {r.text[:200]}")
                outcome = "bad_answer"
                answer = r.json()
                rewards = answer.get("rewards") if isinstance(answer, dict) else None
                if isinstance(rewards, (int, float)) and len(chunk) == 1:
                    rewards = [rewards]
                if not isinstance(rewards, list) or len(rewards) != len(chunk):
                    raise RewardUnavailable(f"reward API {self.url} answered {len(rewards) if isinstance(rewards, list) else rewards!r} "
                                            f"rewards for {len(chunk)} samples")
                values = [_to_float(x, i) for i, x in enumerate(rewards)]
                outcome = "ok"
                return values
            except (httpx.TransportError, ValueError) as e:
                last_error = f"{type(e).__name__}: {e}"
                log.warning("reward API %s attempt %d failed: %s", self.url, attempt + 1, last_error)
            finally:
                if self.metrics is not None:
                    self.metrics.record(outcome, time.perf_counter() - t0)
        raise RewardUnavailable(f"reward API {self.url} gave no reward after {self.retries + 1} attempts ({last_error})")

    def score(self, samples: Sequence[RewardSample]) -> list[ScoreResult]:
        chunks = [samples[i:i + self.batch_size] for i in range(0, len(samples), self.batch_size)]
        out: list[ScoreResult] = []
        for rewards in self.pool.map(self._post, chunks):
            out.extend(ScoreResult(r, {"http": r}) for r in rewards)
        return out
