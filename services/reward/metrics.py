"""The reward server's own Prometheus metrics, in its server's registry (the RPC and process
metrics come with `RPCServer`). The families are always there; their samples appear with the
first HTTP request, and with a scorer that calls a reward API:

    rlhf_http_requests_total{service, path, code}   its OpenRLHF-style HTTP API, per path and status
    rlhf_http_request_seconds{service, path}        ... and their latency
    rlhf_reward_api_requests_total{service, outcome} each request to the user's reward API (HTTPScorer):
                                                      ok, http_error, transport_error, bad_answer
    rlhf_reward_api_seconds{service}                 ... and their latency
    rlhf_reward_api_breaker_state{service}           its circuit breaker: 0 closed, 1 half-open, 2 open
    rlhf_reward_api_breaker_opened_total{service}    times it opened
    rlhf_reward_api_short_circuited_total{service}   requests not sent because it was open

The HTTP API's `Guard` (common/rpc/http_guard.py) feeds the first two, the requests it refuses
itself (401, 413) included; paths outside the API's own are counted as "other" (a scanner cannot
grow the label set).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..common.metrics import LATENCY_BUCKETS

API_PATHS = ("/score", "/get_reward", "/health", "/status")
REWARD_API_OUTCOMES = ("ok", "http_error", "transport_error", "bad_answer")


class HTTPMetrics:
    def __init__(self, registry: CollectorRegistry, service: str = "reward"):
        self.service = service
        self.requests = Counter(
            "rlhf_http_requests_total",
            "HTTP requests answered, by path and status code",
            ["service", "path", "code"],
            registry=registry,
        )
        self.seconds = Histogram(
            "rlhf_http_request_seconds",
            "HTTP request latency, by path",
            ["service", "path"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )

    def record(self, path: str, code: int, seconds: float) -> None:
        self.requests.labels(self.service, path, str(code)).inc()
        self.seconds.labels(self.service, path).observe(seconds)


def path_label(path: str, known=API_PATHS) -> str:
    """The `path` label of a request: its path when the API serves it, else "other"."""
    return path if path in known else "other"


class RewardAPIMetrics:
    """Requests to the user's reward API, one per attempt (a retried request counts each try).
    The families are in every reward server's registry; their samples appear once a scorer that
    calls an API is built (`expect_calls`): every outcome from 0, so a rate over it exists
    before the first failure, and a server without an API shows none."""

    def __init__(self, registry: CollectorRegistry, service: str = "reward"):
        self.service = service
        self.requests = Counter(
            "rlhf_reward_api_requests_total",
            "requests to the reward API (reward.http_url), by outcome",
            ["service", "outcome"],
            registry=registry,
        )
        self.latency = Histogram(
            "rlhf_reward_api_seconds",
            "reward API request latency",
            ["service"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.breaker_state = Gauge(
            "rlhf_reward_api_breaker_state",
            "the reward API's circuit breaker: 0 closed, "
            "1 half-open (one probe out), 2 open (calls fail without reaching it)",
            ["service"],
            registry=registry,
        )
        self.breaker_opened = Counter(
            "rlhf_reward_api_breaker_opened_total",
            "times the reward API's circuit breaker opened",
            ["service"],
            registry=registry,
        )
        self.short_circuited = Counter(
            "rlhf_reward_api_short_circuited_total",
            "reward API requests not sent because its circuit breaker was open",
            ["service"],
            registry=registry,
        )

    def expect_calls(self) -> None:
        """A scorer will call the API: its outcomes and latency start at 0."""
        for outcome in REWARD_API_OUTCOMES:
            self.requests.labels(self.service, outcome)
        self.latency.labels(self.service)
        self.breaker_state.labels(self.service).set(0)
        self.breaker_opened.labels(self.service)
        self.short_circuited.labels(self.service)

    def record(self, outcome: str, seconds: float) -> None:
        self.requests.labels(self.service, outcome).inc()
        self.latency.labels(self.service).observe(seconds)

    def breaker(self, state: str, opened: bool = False) -> None:
        """The breaker is now `state` (closed, half_open, open); `opened`: it just opened."""
        self.breaker_state.labels(self.service).set({"closed": 0, "half_open": 1, "open": 2}[state])
        if opened:
            self.breaker_opened.labels(self.service).inc()

    def refused(self) -> None:
        """A request was not sent: the breaker is open."""
        self.short_circuited.labels(self.service).inc()
