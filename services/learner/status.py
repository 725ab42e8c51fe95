"""The learner service's status (`Learner.Status` over gRPC, `GET /status` over HTTP): what the
run is doing now, read from its parts each time it is asked."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .source import ReplaySource, quietly

if TYPE_CHECKING:
    from ..training.loop import TrainingLoop
    from .liveness import Heartbeat
    from .sink import PushSink
    from .state import LearnerState


class LearnerStatus:
    """The status of the run `training` drives with the replay as its `source` and `sink` as its
    pushes: its iteration and phase, rewards, the replay's counters, the generation servers, the
    critic, the fencing identity, liveness (and the dependency the loop waits for, if any) and
    the reward-hacking watch."""

    def __init__(
        self,
        training: TrainingLoop,
        source: ReplaySource,
        sink: PushSink,
        state: LearnerState,
        heartbeat: Heartbeat,
        t_start: float,
    ):
        self.training, self.source, self.sink, self.state = training, source, sink, state
        self.heartbeat, self.t_start = heartbeat, t_start

    def status(self) -> dict:
        t, store = self.training, self.source.store
        critic_watch = self.source.critic_watch
        return {
            "iteration": t.iteration,
            "total_iterations": t.cfg.run.iterations,
            "policy_version": t.learner.policy_version,
            "state": t.phase.name,
            "last_reward": t.last["reward"],
            "last_eval_reward": t.last["eval"],
            **self.source.counters,
            "generation_servers": quietly(lambda: len(store.live("generation")), 0),
            "replay_backlog": quietly(store.backlog, -1),
            "uptime_s": round(time.time() - self.t_start, 1),
            "resumed_from": self.state.resumed_from,
            "waiting_for": self.heartbeat.waiting_for,
            "stale_streak": self.source.intake.stale_streak,
            "critic": critic_watch.state if critic_watch is not None else {},
            "run_id": self.sink.run_id,
            "fence_epoch": self.sink.fence_epoch,
            "liveness": {**self.heartbeat.status(), "stuck": self.heartbeat.stuck()},
            "reward_hacking_suspected": t.watch.last.suspected,
            "reward_hacking": t.watch.status(),
        }
