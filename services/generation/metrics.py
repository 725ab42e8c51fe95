"""The generation server's own Prometheus metrics, in its server's registry: prompts per batch,
tokens generated and throughput per batch, and per weight update the seconds it waited for the
running batch and the seconds it swapped (the RPC and process metrics come with `RPCServer`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import Counter, Histogram

from ..common.rpc.server import ServiceMetrics, batch_size_histogram
from ..common.types import GenerationResult

if TYPE_CHECKING:
    from ..weights.receiver import Applied


class GenerationMetrics:
    def __init__(self, server_metrics: ServiceMetrics):
        registry, service = server_metrics.registry, server_metrics.service
        self.prompts = batch_size_histogram(server_metrics, "prompts")
        self.tokens = Counter("rlhf_generated_tokens_total", "tokens generated", ["service"], registry=registry).labels(
            service
        )
        self.tokens_per_s = Histogram(
            "rlhf_tokens_per_second",
            "generation throughput per batch",
            ["service"],
            buckets=(10, 100, 1e3, 1e4, 1e5, 1e6),
            registry=registry,
        ).labels(service)
        seconds = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300)
        self.swap_wait = Histogram(
            "rlhf_weight_swap_wait_seconds",
            "seconds a weight update waited for the running batch before its swap",
            ["service"],
            buckets=seconds,
            registry=registry,
        ).labels(service)
        self.swap = Histogram(
            "rlhf_weight_swap_seconds", "seconds a weight swap took", ["service"], buckets=seconds, registry=registry
        ).labels(service)

    def record_swap(self, applied: Applied) -> None:
        """A weight update applied (a push, a shared-memory load or a pull)."""
        self.swap_wait.observe(applied.swap_wait_s)
        self.swap.observe(applied.swap_s)

    def record(self, n_prompts: int, res: GenerationResult) -> None:
        """One backend batch of `n_prompts` prompts that produced `res`."""
        self.prompts.observe(n_prompts)
        self.tokens.inc(res.tokens)
        self.tokens_per_s.observe(res.tokens / max(res.seconds, 1e-9))
