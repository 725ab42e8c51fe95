"""The learner's Prometheus metrics (in the registry its gRPC server exports), each labelled
`service="learner"`. Most are set once per iteration from the metrics dict the iteration
computed (`observe`); the prompt queue an autoscaler of rollout workers watches is read from
Redis every few seconds by a thread of its own (`ReplayPoller`), so a scrape never waits on Redis.
docs/metrics.md lists them all."""

from __future__ import annotations

import logging
import math
import threading
from typing import Callable

from prometheus_client import Counter, Gauge

from ..common.metrics import labelled

log = logging.getLogger(__name__)

SERVICE = "learner"
# the parts of an iteration timed in its metrics (time/<phase>_s), each a `phase` of
# rlhf_learner_phase_seconds; a phase the iteration did not have (no eval) is 0
PHASES = ("wait", "train", "push", "eval")


def phase_seconds(m: dict) -> dict[str, float]:
    """{phase: seconds} of an iteration's metrics: every `time/<phase>_s` key but the whole
    iteration's, and 0 for the PHASES it lacks."""
    out = {p: 0.0 for p in PHASES}
    for k, v in m.items():
        if k.startswith("time/") and k.endswith("_s") and k != "time/iteration_s" and v is not None:
            out[k[len("time/") : -len("_s")]] = float(v)
    return out


def _finite(v, default: float = math.nan) -> float:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else default


class LearnerMetrics:
    def __init__(self, registry):
        self.registry = registry
        gauge, counter = labelled(Gauge, registry, SERVICE), labelled(Counter, registry, SERVICE)
        self._per_iteration(gauge)
        self._replay(gauge, counter)
        self._parity()

    def _per_iteration(self, gauge) -> None:
        """The gauges `observe` sets from each iteration's metrics."""
        self.iteration = gauge("rlhf_learner_iteration", "completed iterations")
        self.policy_version = gauge("rlhf_learner_policy_version", "newest policy version")
        self.reward = gauge("rlhf_learner_reward", "mean training reward of the last batch")
        self.reward_min = gauge("rlhf_learner_reward_min", "lowest training reward in the last batch")
        self.reward_max = gauge("rlhf_learner_reward_max", "highest training reward in the last batch")
        self.eval_reward = gauge("rlhf_learner_eval_reward", "held-out reward of the last eval")
        self.kl = gauge("rlhf_learner_kl", "KL to the reference of the last batch")
        self.clip_fraction = gauge(
            "rlhf_learner_clip_fraction",
            "share of tokens whose ratio was clipped in the last iteration's updates (ppo/pg_clipfrac)",
        )
        self.entropy = gauge("rlhf_learner_entropy", "policy entropy per token on the last batch (ppo/entropy_rollout)")
        self.tokens_per_s = gauge(
            "rlhf_learner_generation_tokens_per_second",
            "generation throughput behind the last batch (rollout/tokens_per_s)",
        )
        self.hacking = gauge(
            "rlhf_learner_reward_hacking",
            "1 while the reward-hacking watch suspects reward "
            "hacking (held-out reward falling, train reward rising), else 0",
        )
        self.drift_kl = gauge(
            "rlhf_learner_rollout_drift_kl",
            "KL between the sampler and the learner on the last batch's tokens "
            "(rollout_correction/kl; NaN: not measured)",
        )
        self.drift_ess = gauge(
            "rlhf_learner_rollout_drift_ess",
            "normalised effective sample size of the sampler/learner ratios per sequence (rollout_correction/ess_seq)",
        )
        self.drift_masked = gauge(
            "rlhf_learner_rollout_masked_fraction",
            "share of tokens the rollout correction masked on the last batch (rollout_correction/masked_token_frac)",
        )
        self.distill_kl = gauge(
            "rlhf_learner_distill_reverse_kl",
            "on-policy distillation: per-token reverse KL of the student to the teacher on the last batch "
            "(distill/reverse_kl; NaN: no distillation)",
        )
        self.distill_agree = gauge(
            "rlhf_learner_distill_top1_agreement",
            "share of the last batch's sampled tokens that are the teacher's most likely "
            "(distill/teacher_top1_agree; NaN: distill.top_k 0 or no distillation)",
        )
        self.staleness = gauge("rlhf_replay_staleness", "mean policy-version lag of the last batch")
        self.backlog = gauge("rlhf_replay_lag", "trajectory groups waiting for the learner")
        self.push_seconds = gauge("rlhf_learner_push_seconds", "seconds of the last weight push")
        self.iteration_seconds = gauge("rlhf_learner_iteration_seconds", "seconds of the last iteration")
        self.phases = Gauge(
            "rlhf_learner_phase_seconds",
            "seconds of each part of the last iteration",
            ["service", "phase"],
            registry=self.registry,
        )
        for p in PHASES:
            self.phases.labels(SERVICE, p)

    def _replay(self, gauge, counter) -> None:
        """The prompt queue's gauges (`queue`) and the counters of groups and prompts left out (`counted`)."""
        self.prompts_waiting = gauge(
            "rlhf_replay_prompts_waiting",
            "prompts in the prompt stream not done: not yet delivered to a rollout worker, or delivered and pending",
        )
        self.prompts_pending = gauge(
            "rlhf_replay_prompts_pending",
            "prompts delivered to a rollout worker and not yet done (part of rlhf_replay_prompts_waiting)",
        )
        self.dropped = counter("rlhf_replay_dropped_stale_total", "groups dropped as too stale")
        self.duplicates = counter(
            "rlhf_replay_duplicates_total", "groups skipped: their prompt was already trained or in the batch"
        )
        self.malformed = counter("rlhf_replay_malformed_total", "groups dropped as malformed")
        self.dead_letters = counter("rlhf_replay_dead_letters_total", "dead-lettered prompts the learner replaced")
        self.dropped_equal = counter(
            "rlhf_replay_dropped_equal_total",
            "groups whose rewards were all equal, dropped by dynamic sampling (rollout.dynamic_sampling)",
        )
        self._seen = {"dropped_stale": 0, "duplicates": 0, "malformed": 0, "dead_letters": 0, "dropped_equal": 0}

    def _parity(self) -> None:
        """Per generation server, its last push parity check (parity.py), and the checks it failed."""

        def per_server(cls, name: str, doc: str):
            return cls(name, doc, ["service", "server"], registry=self.registry)

        self.parity_max_abs = per_server(
            Gauge, "rlhf_push_parity_max_abs", "largest |log-prob difference| on the probe batch at the last check"
        )
        self.parity_mean_abs = per_server(
            Gauge, "rlhf_push_parity_mean_abs", "mean |log-prob difference| per probe token at the last check"
        )
        self.parity_kl = per_server(Gauge, "rlhf_push_parity_kl", "KL estimate (learner || server) at the last check")
        self.parity_failures = per_server(
            Counter, "rlhf_push_parity_failures_total", "push parity checks the server failed"
        )

    def parity(self, server: str, max_abs: float, mean_abs: float, kl: float, failed: bool) -> None:
        """One server's push parity check (its failures counter starts at 0 with its first check)."""
        self.parity_max_abs.labels(SERVICE, server).set(max_abs)
        self.parity_mean_abs.labels(SERVICE, server).set(mean_abs)
        self.parity_kl.labels(SERVICE, server).set(kl)
        failures = self.parity_failures.labels(SERVICE, server)
        if failed:
            failures.inc()

    def observe(self, iteration: int, m: dict, counters: dict) -> None:
        """One iteration's metrics `m` and the service's running `counters` into the gauges and counters."""
        self.iteration.set(iteration)
        if "policy/version" in m:
            self.policy_version.set(m["policy/version"])
        self.reward.set(_finite(m.get("reward/score_mean")))
        self.reward_min.set(_finite(m.get("reward/score_min")))
        self.reward_max.set(_finite(m.get("reward/score_max")))
        if "eval/reward_mean" in m:
            self.eval_reward.set(m["eval/reward_mean"])
        self.kl.set(_finite(m.get("ppo/kl_ref"), 0.0))
        self.clip_fraction.set(_finite(m.get("ppo/pg_clipfrac"), 0.0))
        self.entropy.set(_finite(m.get("ppo/entropy_rollout")))
        self.tokens_per_s.set(_finite(m.get("rollout/tokens_per_s"), 0.0))
        self.drift_kl.set(_finite(m.get("rollout_correction/kl")))
        self.drift_ess.set(_finite(m.get("rollout_correction/ess_seq")))
        self.drift_masked.set(_finite(m.get("rollout_correction/masked_token_frac")))
        self.distill_kl.set(_finite(m.get("distill/reverse_kl")))
        self.distill_agree.set(_finite(m.get("distill/teacher_top1_agree")))
        self.staleness.set(m.get("replay/staleness_mean", 0.0))
        self.backlog.set(m.get("replay/backlog", 0))
        self.push_seconds.set(m.get("time/push_s", 0.0))
        self.iteration_seconds.set(m.get("time/iteration_s", 0.0))
        for phase, secs in phase_seconds(m).items():
            self.phases.labels(SERVICE, phase).set(secs)
        self.counted(counters)

    def counted(self, counters: dict, restored: bool = False) -> None:
        """Advance the counters by what the service's running totals grew since the last call;
        `restored` totals (from a checkpoint) are taken as the start, so the Prometheus counters
        count this process's events only (a restart is a counter reset, not a jump)."""
        for key, metric in (
            ("dropped_stale", self.dropped),
            ("duplicates", self.duplicates),
            ("malformed", self.malformed),
            ("dead_letters", self.dead_letters),
            ("dropped_equal", self.dropped_equal),
        ):
            now = int(counters.get(key, 0))
            if not restored and now > self._seen[key]:
                metric.inc(now - self._seen[key])
            self._seen[key] = max(now, self._seen[key]) if not restored else now

    def suspected(self, flag: bool) -> None:
        self.hacking.set(1.0 if flag else 0.0)

    def queue(self, waiting: int, pending: int) -> None:
        self.prompts_waiting.set(waiting)
        self.prompts_pending.set(pending)


class ReplayPoller:
    """Calls `read()` -> (waiting, pending) every `every_s` seconds on a daemon thread and hands
    the numbers to `update`; a failed read (Redis restarting) keeps the last numbers."""

    def __init__(self, read: Callable[[], tuple[int, int]], update: Callable[[int, int], None], every_s: float):
        self.read, self.update, self.every_s = read, update, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="replay-poller", daemon=True)

    def start(self) -> "ReplayPoller":
        self._thread.start()
        return self

    def poll(self) -> None:
        try:
            self.update(*self.read())
        except Exception as e:
            log.debug("could not read the prompt queue: %s", e)

    def _loop(self) -> None:
        while True:
            self.poll()
            if self._stop.wait(self.every_s):
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
