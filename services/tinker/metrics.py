"""The Tinker API's Prometheus metrics, served at its own `/metrics` (on its HTTP port, behind the
run's token unless `rpc.open_metrics`), every sample labelled `service="tinker"`:

    rlhf_http_requests_total{service, path, code}   every request, by route and HTTP status (the
                                                     401s and 413s answered before the app too)
    rlhf_http_request_seconds{service, path}        ... and their latency (a training request
                                                     answers with a future at once: its work is
                                                     rlhf_tinker_work_seconds)
    rlhf_tinker_work_seconds{service, kind}         the compute thread's work: forward_backward,
                                                     optim_step, sample (on a thread of its own
                                                     with tinker.generation), ...
    rlhf_tinker_sessions{service}                   client sessions held now
    rlhf_tinker_training_models{service}            training models (LoRA or full, each with its
                                                     optimiser) held now
    rlhf_tinker_samplers{service}                   sampling sessions held now
    rlhf_tinker_requests_pending{service}           futures not yet computed
and the process's (`process_*`, `python_info`). docs/metrics.md lists them.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Iterable

from prometheus_client import Histogram
from prometheus_client.core import GaugeMetricFamily

from ..common.metrics import HttpMetrics

if TYPE_CHECKING:
    from .api import TinkerApi

# the compute thread's work takes seconds to minutes on a CPU: buckets past the RPC latencies'
WORK_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class RouteLabels:
    """The `path` label of a request: the route it matched, its path parameters as `{name}`, else
    "other" (a scanner cannot grow the label set)."""

    def __init__(self, templates: Iterable[str]):
        templates = list(templates)
        self.static = {t for t in templates if "{" not in t}
        self.patterns = [(re.compile(_pattern(t)), t) for t in templates if "{" in t]

    def __call__(self, path: str) -> str:
        if path in self.static:
            return path
        return next((t for p, t in self.patterns if p.fullmatch(path)), "other")


def _pattern(template: str) -> str:
    """A route template's regex: each `{name}` one path segment, the rest as written."""
    return "".join("[^/]+" if part.startswith("{") else re.escape(part) for part in re.split(r"(\{[^}]+\})", template))


class ApiCollector:
    """The API's sessions, models, samplers and pending requests, read at each scrape."""

    def __init__(self, api: TinkerApi, service: str):
        self.api, self.service = api, service

    def collect(self):
        api, labels = self.api, [self.service]
        out = []
        for name, doc, value in (
            ("rlhf_tinker_sessions", "client sessions the Tinker API holds now", len(api.sessions)),
            ("rlhf_tinker_training_models", "training models (each with its optimiser) held now", len(api.models)),
            ("rlhf_tinker_samplers", "sampling sessions held now", len(api.samplers)),
            ("rlhf_tinker_requests_pending", "requests whose future is not computed yet", api.futures.pending()),
        ):
            g = GaugeMetricFamily(name, doc, labels=["service"])
            g.add_metric(labels, value)
            out.append(g)
        return out


class TinkerMetrics:
    """The Tinker API's registry (`http`: its requests, the process's) with the compute thread's
    work and the API's holdings; `routes` names a request's route (set once the app is built)."""

    def __init__(self, api: TinkerApi, service: str = "tinker"):
        self.http, self.service = HttpMetrics(service), service
        self.work = Histogram(
            "rlhf_tinker_work_seconds",
            "seconds the compute thread spent on a request, by kind",
            ["service", "kind"],
            buckets=WORK_BUCKETS,
            registry=self.http.registry,
        )
        self.http.registry.register(ApiCollector(api, service))
        self.routes = RouteLabels([])

    def request(self, path: str, code: int, seconds: float) -> None:
        self.http.request(self.routes(path), code, seconds)

    def worked(self, kind: str, seconds: float) -> None:
        self.work.labels(self.service, kind).observe(seconds)
