"""When to evaluate, checkpoint and stop: one schedule for the in-process trainer and the
learner service."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..common.config import Config
    from ..common.config_sections import RunConfig


@dataclass
class Tick:
    last: bool  # the final iteration (the configured count, or out of wall-clock time)
    out_of_time: bool  # run.max_wall_s is spent
    evaluate: bool  # held-out eval after this iteration (every eval_interval, and the last)
    checkpoint: bool  # checkpoint after this iteration (every checkpoint_interval, and the last)


class Schedule:
    def __init__(self, run_cfg: RunConfig, t_start: float | None = None):
        self.cfg = run_cfg
        self.t_start = time.time() if t_start is None else t_start

    def at(self, iteration: int) -> Tick:
        c = self.cfg
        out_of_time = c.max_wall_s is not None and time.time() - self.t_start > c.max_wall_s
        last = iteration >= c.iterations or out_of_time
        return Tick(
            last,
            out_of_time,
            evaluate=last or bool(c.eval_interval and iteration % c.eval_interval == 0),
            checkpoint=last or bool(c.checkpoint_interval and iteration % c.checkpoint_interval == 0),
        )


def planned_updates(cfg: Config) -> int:
    """Optimiser steps over the whole run (for the LR schedule)."""
    samples_per_iter = cfg.rollout_batch_size * cfg.num_return_sequences_in_group
    return cfg.run.iterations * cfg.ppo_epochs * math.ceil(samples_per_iter / cfg.ppo_mini_batch_size)
