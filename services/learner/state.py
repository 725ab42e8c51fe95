"""What the learner service keeps in a checkpoint beside the critic's (`LearnerState`): written on
the schedule, at a stop and at the end (then the trajectories it includes are acknowledged), and
read back at the start; with no checkpoint the run's replay namespace starts afresh."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..common.rpc.retry import DependencyUnavailable
from ..training.watch import restore_watch
from .source import quietly

if TYPE_CHECKING:
    from ..training.loop import TrainingLoop
    from .checkpoint import Checkpointer
    from .metrics import LearnerMetrics
    from .sink import PushSink
    from .source import ReplaySource
    from .trainer import PolicyTrainer

log = logging.getLogger(__name__)


class LearnerState:
    """The state of the `learner`, the replay `source` (the feeder's place, the intake's counters)
    and the `training` loop (iteration, baseline, watch), with the RNG, through `checkpointer`;
    versions from the `sink`'s counter; the restored counts into `metrics`. `logger`: where its
    lines go (the entry point's, so they name it)."""

    def __init__(
        self,
        checkpointer: Checkpointer,
        learner: PolicyTrainer,
        training: TrainingLoop,
        source: ReplaySource,
        sink: PushSink,
        metrics: LearnerMetrics,
        logger: logging.Logger | None = None,
    ):
        self.checkpointer, self.learner, self.training = checkpointer, learner, training
        self.source, self.sink, self.metrics = source, sink, metrics
        self.log = logger or log
        self.resumed_from: int | None = None  # the iteration this process resumed from, if it did

    def state_dict(self) -> dict:
        t, source = self.training, self.source
        return {
            "learner": self.learner.state_dict(),
            "feeder": source.feeder.state_dict(),
            "iteration": t.iteration,
            "counters": dict(source.intake.counters),
            "baseline": t.baseline,
            "torch_rng": torch.get_rng_state(),
            "watch": t.watch.state_dict(),
        }

    def save(self) -> Path:
        iteration = self.training.iteration
        intake = self.source.intake
        try:
            path = self.checkpointer.save(
                iteration,
                self.state_dict(),
                intake.uncommitted,
                write_actor=self.learner.save_actor if self.learner.sharded else None,
            )
        except DependencyUnavailable as e:
            raise DependencyUnavailable(f"the checkpoint of iteration {iteration} was not written: {e}") from None
        intake.committed()
        return path

    def resume(self) -> int:
        """Load the newest checkpoint if there is one; otherwise start the namespace afresh.
        Returns the iteration to continue after."""
        ckpt = self.checkpointer.latest()
        if ckpt is None:
            return self._fresh()
        state = self.checkpointer.load(ckpt)
        self.learner.load_state_dict(state["learner"], ckpt / "actor")
        self.source.feeder.load_state_dict(state["feeder"])
        torch.set_rng_state(state["torch_rng"])
        t = self.training
        t.iteration, t.baseline = int(state["iteration"]), state["baseline"]
        self.source.intake.counters.update(state["counters"])
        self.metrics.counted(self.source.counters, restored=True)  # Prometheus counts this process's events
        restore_watch(t.watch, state.get("watch", {}), self.log.warning)  # absent in older checkpoints
        self.metrics.suspected(t.watch.last.suspected)
        # versions only go forward: the restored weights get a number above anything served
        self.learner.policy_version = self.sink.next_version()
        self.resumed_from = t.iteration
        self.log.info(
            "resumed from checkpoint %s (iteration %d); policy is now version %d",
            ckpt.name,
            t.iteration,
            self.learner.policy_version,
        )
        return t.iteration

    def _fresh(self) -> int:
        """No checkpoint: the replay namespace cleared, versions numbered above what servers left
        over from an earlier run serve."""
        store = self.source.store
        prior = quietly(lambda: store.live("generation"), {})
        n = store.reset()
        if n:
            self.log.info("fresh run: cleared %d keys of replay namespace %r", n, store.ns)
        top = max((int(i.get("policy_version", 0)) for i in prior.values()), default=0)
        if top > 0:  # servers left over from an earlier run serve newer-numbered weights
            store.raise_version_to(top)
            self.learner.policy_version = self.sink.next_version()
        return 0
