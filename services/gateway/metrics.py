"""The gateway's Prometheus metrics, served at its own `/metrics` (on its HTTP port, behind the
run's token unless `rpc.open_metrics`), every sample labelled `service="gateway"`:

    rlhf_http_requests_total{service, path, code}   every request, by route and HTTP status (the
                                                     401s and 413s answered before the app too)
    rlhf_http_request_seconds{service, path}        ... and their latency
    rlhf_gateway_turn_seconds{service}              a sampled turn: the request's checks, its
                                                     tokens, the Generate call, the answer
    rlhf_gateway_sessions{service}                  sessions held now
    rlhf_gateway_session_bytes{service}             what they hold together (Sessions.bytes)
    rlhf_gateway_sessions_evicted_total{service, reason}  sessions forgotten: idle (time to
                                                     live), count (max_sessions), bytes
                                                     (max_sessions_bytes)
and the process's (`process_*`, `python_info`). docs/metrics.md lists them.
"""

from __future__ import annotations

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..agents.session_store import Sessions
from ..common.metrics import LATENCY_BUCKETS, HttpMetrics


class SessionsCollector:
    """The sessions' count, bytes and evictions, read at each scrape."""

    def __init__(self, sessions: Sessions, service: str):
        self.sessions, self.service = sessions, service

    def collect(self):
        s, labels = self.sessions, [self.service]
        count = GaugeMetricFamily("rlhf_gateway_sessions", "sessions the gateway holds now", labels=["service"])
        count.add_metric(labels, len(s))
        held = GaugeMetricFamily(
            "rlhf_gateway_session_bytes",
            "bytes the sessions hold together, as the gateway counts them",
            labels=["service"],
        )
        held.add_metric(labels, s.bytes)
        evicted = CounterMetricFamily(
            "rlhf_gateway_sessions_evicted",
            "sessions forgotten before they were ended, by reason (idle, count, bytes)",
            labels=["service", "reason"],
        )
        for reason, n in s.evicted.items():
            evicted.add_metric([self.service, reason], n)
        return [count, held, evicted]


class GatewayMetrics:
    """The gateway's registry (`http`: its requests, the process's) with its turns and sessions."""

    def __init__(self, sessions: Sessions, service: str = "gateway"):
        self.http = HttpMetrics(service)
        self.turn_seconds = Histogram(
            "rlhf_gateway_turn_seconds",
            "seconds a sampled turn took, from its request's checks to its answer",
            ["service"],
            buckets=LATENCY_BUCKETS,
            registry=self.http.registry,
        ).labels(service)
        self.http.registry.register(SessionsCollector(sessions, service))
