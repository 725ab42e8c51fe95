"""The prompt feeder: keeps the prompt stream `max_staleness` batches ahead of training, in epochs
of the training set, and feeds a replacement for each prompt that was dead-lettered."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..common.replay.records import make_task
from ..training.data import EpochSampler

if TYPE_CHECKING:
    from ..common.config import Config

log = logging.getLogger(__name__)


class PromptFeeder:
    def __init__(self, cfg: Config, store, records):
        self.cfg, self.store = cfg, store
        self.sampler = EpochSampler(records, cfg.run.seed)
        self.fed_batches = 0  # batches fed since the run began
        self.dead_cursor = "0-0"  # the newest dead letter replaced
        self.dead_letters = 0

    def _feed(self, n: int, policy_version: int) -> None:
        tasks = [
            make_task(rec, epoch, policy_version, policy_version, self.cfg.num_return_sequences_in_group)
            for epoch, rec in self.sampler.take_with_epochs(n)
        ]
        self.store.feed(tasks)

    def feed(self, iteration: int, policy_version: int) -> None:
        """Feed batches until `max_staleness` batches beyond `iteration` are in the stream (0: just
        this iteration's), never beyond the run's last iteration."""
        target = min(iteration + self.cfg.max_staleness, self.cfg.run.iterations)
        while self.fed_batches < target:
            self._feed(self.cfg.rollout_batch_size, policy_version)
            self.fed_batches += 1

    def feed_more(self, n: int, policy_version: int) -> None:
        """`n` prompts more, beyond the batches (dynamic sampling's, in place of dropped groups)."""
        self._feed(n, policy_version)

    def replace_dead_letters(self, policy_version: int) -> int:
        """Feed one new prompt per prompt dead-lettered since the last call. Returns how many."""
        dead = self.store.read_dead(self.dead_cursor)
        for entry_id, task, error in dead:
            log.error("prompt %s was dead-lettered (%s); feeding a replacement", task.uid, error)
            self.dead_cursor = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            self._feed(1, policy_version)
            self.dead_letters += 1
        return len(dead)

    @property
    def data_epoch(self) -> int:
        return self.sampler.epoch

    def state_dict(self) -> dict:
        return {
            "sampler": self.sampler.state_dict(),
            "fed_batches": self.fed_batches,
            "dead_cursor": self.dead_cursor,
            "dead_letters": self.dead_letters,
        }

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.fed_batches, self.dead_cursor = int(state["fed_batches"]), state["dead_cursor"]
        self.dead_letters = int(state["dead_letters"])
