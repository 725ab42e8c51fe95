"""The learner's Prometheus metrics (in the registry its gRPC server exports)."""
from __future__ import annotations

from prometheus_client import Counter, Gauge


class LearnerMetrics:
    def __init__(self, registry):
        g = lambda name, doc: Gauge(name, doc, registry=registry)  # noqa: E731
        self.iteration = g("rlhf_learner_iteration", "completed iterations")
        self.version = g("rlhf_learner_policy_version", "newest policy version")
        self.reward = g("rlhf_learner_reward", "mean training reward of the last batch")
        self.eval_reward = g("rlhf_learner_eval_reward", "held-out reward of the last eval")
        self.kl = g("rlhf_learner_kl", "KL to the reference of the last batch")
        self.staleness = g("rlhf_replay_staleness", "mean policy-version lag of the last batch")
        self.backlog = g("rlhf_replay_lag", "trajectory groups waiting for the learner")
        self.push_seconds = g("rlhf_learner_push_seconds", "seconds of the last weight push")
        self.iteration_seconds = g("rlhf_learner_iteration_seconds", "seconds of the last iteration")
        self.dropped = Counter("rlhf_replay_dropped_stale_total", "groups dropped as too stale", registry=registry)
        self._dropped_seen = 0

    def observe(self, service, m: dict) -> None:
        self.iteration.set(service.iteration)
        self.version.set(service.learner.version)
        self.reward.set(m.get("reward/score_mean", float("nan")))
        if "eval/reward_mean" in m:
            self.eval_reward.set(m["eval/reward_mean"])
        self.kl.set(m.get("ppo/kl_ref", 0.0))
        self.staleness.set(m.get("replay/staleness_mean", 0.0))
        self.backlog.set(m.get("replay/backlog", 0))
        self.push_seconds.set(m.get("time/push_s", 0.0))
        self.iteration_seconds.set(m.get("time/iteration_s", 0.0))
        d = service.intake.counters["dropped_stale"]
        self.dropped.inc(d - self._dropped_seen)
        self._dropped_seen = d
