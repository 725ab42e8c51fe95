"""The learner service's rollout source (`ReplaySource`): fresh, unique trajectory groups the
rollout workers left in the replay buffer, for prompts the feeder keeps queued ahead; and
`CriticWatch`, which notices a restarted critic server before each batch."""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from ..common.replay import ReplayStore
from ..common.types import Rollout
from ..training.loop import Batch, Phase
from .feeder import PromptFeeder
from .intake import TrajectoryIntake

log = logging.getLogger(__name__)


def quietly(fn: Callable[[], Any], default: Any) -> Any:
    """`fn()`, or `default` when it raises (a status field must not fail the status)."""
    try:
        return fn()
    except Exception:
        return default


class CriticWatch:
    """Notices a restarted critic server: which state it came back with (the newest checkpoint's
    critic or its initial weights) goes into the log and `state` (the status's "critic").
    `logger`: where its warning goes (the entry point's, so its lines name it)."""

    def __init__(self, critic, logger: logging.Logger | None = None):
        self.critic = critic
        self.state: dict = {}
        self.log = logger or log

    def check(self, iteration: int) -> None:
        info = self.critic.info()
        before = self.state.get("incarnation")
        restarts = self.state.get("restarts", 0)
        if before is not None and before != info.incarnation:
            restarts += 1
            self.log.warning(
                "the critic server restarted; it serves %s (step %d): the value function is as of that "
                "checkpoint, the policy is at iteration %d",
                info.loaded_from or "its initial weights",
                info.step,
                iteration,
            )
        self.state = {
            "incarnation": info.incarnation,
            "loaded_from": info.loaded_from,
            "step": info.step,
            "restarts": restarts,
        }


class ReplaySource:
    """The rollout source of the learner service: fresh, unique trajectory groups the rollout
    workers left in the replay buffer (`intake`), for prompts the `feeder` keeps queued ahead."""

    wait_metric = "time/wait_s"

    def __init__(
        self,
        store: ReplayStore,
        feeder: PromptFeeder,
        intake: TrajectoryIntake,
        stop_event: threading.Event,
        phase: Phase,
        critic_watch: CriticWatch | None = None,
    ):
        self.store, self.feeder, self.intake, self.stop_event = store, feeder, intake, stop_event
        self.phase, self.critic_watch = phase, critic_watch

    @property
    def data_epoch(self) -> int:
        return self.feeder.data_epoch

    @property
    def counters(self) -> dict:
        """The intake's running counts and the dead letters the feeder replaced (the status's,
        the checkpoint's, Prometheus')."""
        return {**self.intake.counters, "dead_letters": self.feeder.dead_letters}

    def collect(self, iteration: int, policy_version: int) -> Batch | None:
        if self.critic_watch is not None:
            self.critic_watch.check(iteration - 1)
        self.feeder.feed(iteration, policy_version)
        self.phase.enter("waiting")
        batch = self.intake.collect(policy_version, self.stop_event)
        if batch is None:
            return None
        return Batch(Rollout.from_groups([g for _, g in batch]), policy_version, items=batch)

    def trained(self, batch: Batch, iteration: int) -> dict:
        self.intake.trained(batch.items)
        rollout = batch.rollout
        staleness = [batch.policy_version - v for v in rollout.policy_versions]
        return {
            "rollout/tokens": sum(len(r) for r in rollout.response_ids),
            "rollout/tokens_per_s": self.intake.tokens_per_s(),
            "replay/staleness_mean": sum(staleness) / len(staleness),
            "replay/backlog": quietly(self.store.backlog, -1),
            "replay/dropped_stale": self.intake.counters["dropped_stale"],
            "replay/duplicates": self.intake.counters["duplicates"],
            **self._equal_groups(len(batch.items)),
        }

    def _equal_groups(self, trained: int) -> dict:
        """With dynamic sampling (training/dapo.py, as `train --local` reports it): the share of the
        groups read for the batch whose rewards were all equal, and how many of those it trains on."""
        if not self.intake.cfg.rollout.dynamic_sampling:
            return {}
        equal = self.intake.equal
        return {
            "rollout/equal_groups_frac": (equal["dropped"] + equal["trained"]) / max(equal["dropped"] + trained, 1),
            "rollout/equal_groups_trained": equal["trained"],
            "replay/dropped_equal": self.intake.counters["dropped_equal"],
        }
