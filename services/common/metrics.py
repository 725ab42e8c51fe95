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

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.metrics_core import Metric


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
