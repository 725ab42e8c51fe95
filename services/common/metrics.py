"""Prometheus metrics every service exports alongside its own: the process it runs in (CPU
seconds, resident memory, open file descriptors, start time: prometheus_client's
`ProcessCollector`) and the Python it runs on (`python_info`: `PlatformCollector`), each sample
labelled with the service's name like every other metric of the system.

    registry = CollectorRegistry()
    register_process_metrics(registry, "learner")   # process_*{service="learner"}, python_info{...}

Several servers in one process (the tests) each export the same process's numbers.
docs/metrics.md lists every metric of every service.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.metrics_core import Metric

# request latencies, RPC and HTTP alike: a millisecond to a minute
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServiceLabelled:
    """A collector that yields `inner`'s families with `service="<name>"` added to every sample."""

    def __init__(self, inner, service: str):
        self.inner, self.service = inner, service

    def collect(self):
        for family in self.inner.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [s._replace(labels={"service": self.service, **s.labels}) for s in family.samples]
            yield out


def register_process_metrics(registry: CollectorRegistry, service: str) -> None:
    """Add `process_*` (on Linux, read from /proc at each scrape) and `python_info`, labelled
    with `service`, to `registry`."""
    for inner in (ProcessCollector(registry=None), PlatformCollector(registry=None)):
        registry.register(ServiceLabelled(inner, service))


def labelled(metric_cls, registry: CollectorRegistry, service: str):
    """A maker of `metric_cls` (Counter, Gauge, ...) metrics in `registry` whose one label is
    `service`: make(name, doc, **kwargs) -> the child for this service."""

    def make(name: str, doc: str, **kwargs):
        return metric_cls(name, doc, ["service"], registry=registry, **kwargs).labels(service)

    return make


class HttpMetrics:
    """The metrics of a service that answers HTTP itself (the gateway, the Tinker API): a registry
    holding the process's metrics and every answered request, counted and timed by its route
    label, and what /metrics serves. The service adds its own metrics to `registry`.

        rlhf_http_requests_total{service, path, code}   every request, by route and HTTP status
        rlhf_http_request_seconds{service, path}        ... and their latency

    `path` is the route a request matched (its parameters as `{name}`), never the raw path: the
    service names it, so a scanner cannot grow the label set."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, service: str):
        self.registry, self.service = CollectorRegistry(), service
        register_process_metrics(self.registry, service)
        self._requests = Counter(
            "rlhf_http_requests_total",
            "HTTP requests answered, by path and status code",
            ["service", "path", "code"],
            registry=self.registry,
        )
        self._seconds = Histogram(
            "rlhf_http_request_seconds",
            "HTTP request latency, by path",
            ["service", "path"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

    def request(self, route: str, code: int, seconds: float) -> None:
        self._requests.labels(self.service, route, str(code)).inc()
        self._seconds.labels(self.service, route).observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
