"""A rollout worker's Prometheus metrics (`rlhf_rollout_*`, docs/metrics.md), each labelled
`service="rollout"`, and its process's."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..common.metrics import labelled, register_process_metrics

# kinds of rlhf_rollout_errors_total: waiting for the reward or critic server, no generation server
# registered, a dependency gone longer than the worker waits, an error in the claim loop, a batch
# the reward API failed on every try and prompt by prompt (left pending), an agent service
# (rollout.agent_url) that did not answer, and the
# gRPC status codes (lower case) of failed calls, the common ones listed (any other may appear)
ERROR_KINDS = (
    "waiting",
    "no_generation_server",
    "dependency",
    "loop",
    "reward_api",
    "agent_service",
    "unavailable",
    "deadline_exceeded",
)


class WorkerMetrics:
    """A worker's Prometheus metrics, each labelled `service="rollout"`, and its process's."""

    SERVICE = "rollout"

    def __init__(self):
        self.registry = CollectorRegistry()
        r, service = self.registry, self.SERVICE

        counter = labelled(Counter, r, service)

        self.claimed = counter("rlhf_rollout_prompts_claimed_total", "prompts claimed")
        self.reclaimed = counter("rlhf_rollout_prompts_reclaimed_total", "prompts taken over from a silent worker")
        self.produced = counter("rlhf_rollout_groups_produced_total", "trajectory groups appended")
        self.duplicates = counter("rlhf_rollout_duplicates_total", "prompt attempts that already had trajectories")
        self.dead = counter("rlhf_rollout_dead_letters_total", "prompts no worker can process")
        self.score_retries = counter(
            "rlhf_rollout_score_retries_total", "batches scored again after the reward API failed them"
        )
        self.dropped = counter(
            "rlhf_rollout_groups_dropped_total",
            "groups dropped (dead-lettered) because the reward API could not score them",
        )
        self.errors = Counter("rlhf_rollout_errors_total", "failed service calls", ["service", "kind"], registry=r)
        for kind in ERROR_KINDS:  # from 0, so an alert's rate exists before the first error
            self.error(kind)
        self.backpressure = counter("rlhf_rollout_backpressure_seconds_total", "seconds paused on a full buffer")
        self.batch_seconds = Histogram(
            "rlhf_rollout_batch_seconds",
            "claim to append, per batch",
            ["service"],
            registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        ).labels(service)
        self.in_flight = Gauge(
            "rlhf_rollout_batches_in_flight", "batches being processed", ["service"], registry=r
        ).labels(service)
        register_process_metrics(r, service)

    def error(self, kind: str):
        """The `rlhf_rollout_errors_total` child of `kind`."""
        return self.errors.labels(self.SERVICE, kind)

    def waiting(self, msg: str | None) -> None:
        """A client's `RideThrough.on_wait`: each wait for the reward or critic server counted
        (kind "waiting"); None (answered again) is not."""
        if msg:
            self.error("waiting").inc()
