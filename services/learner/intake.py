"""Trajectory intake: reads groups from the replay buffer into a batch of `rollout_batch_size`
fresh, unique groups, and remembers which trained groups wait for a checkpoint.

For each group read:
    its prompt already trained (ledger), in this batch, or trained since the last checkpoint
        -> acknowledged and skipped (a duplicate)
    sampled by a policy more than `max_staleness` versions old (or from the future): its newest
    token's version, when its decoding crossed a weight update (the older tokens beyond the bound
    are left out of the loss by the learner, `ppo.staleness_weights`)
        -> dropped; its prompt is fed again with a higher attempt number. A long run of such
           drops with nothing fresh in between means the generation servers do not serve the
           learner's weights: it is reported (log and status `stale_streak`), with the reason
    malformed -> dropped with an error in the log
    its rewards all equal, with `rollout.dynamic_sampling` (DAPO; training/dapo.py)
        -> dropped (acknowledged, not trained) and one more prompt fed in its place, up to
           (dynamic_sampling_max_rounds - 1) x rollout_batch_size per batch; past that, into the
           batch, with a warning
    otherwise -> into the batch
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING

from ..common.replay.records import group_from_proto
from ..common.types import Progress, no_progress
from ..training.dapo import informative

if TYPE_CHECKING:
    from ..common.config import Config

log = logging.getLogger(__name__)


class TrajectoryIntake:
    def __init__(self, cfg: Config, store, feeder, on_progress: Progress = no_progress):
        """`on_progress`: called at each tick of `collect`'s wait."""
        self.cfg, self.store, self.feeder, self.on_progress = cfg, store, feeder, on_progress
        self._queue: deque = deque()  # (entry id, record, prompt already trained) read, not yet examined
        self.uncommitted: list[tuple[bytes | str, str]] = []  # (entry id, prompt uid) trained, not checkpointed
        self._uncommitted_uids: set[str] = set()
        self.gen_rates: list[float] = []  # tokens/s of the Generate calls behind the last batch
        self.counters = {"trained_groups": 0, "dropped_stale": 0, "duplicates": 0, "malformed": 0, "dropped_equal": 0}
        self.equal = {"dropped": 0, "trained": 0}  # the last batch's groups whose rewards were all equal
        self.stale_streak = 0  # groups dropped as stale in a row, since the last fresh one
        self._streak_reported = 0

    def _enqueue(self, entries: list) -> None:
        """Queue read entries with whether their prompt is already trained (one round trip)."""
        trained = self.store.trained_among([m.task.uid for _, m in entries])
        self._queue.extend((e, m, t) for (e, m), t in zip(entries, trained))

    def reread_pending(self) -> int:
        """After a restart: queue what was read before it and not checkpointed."""
        self._enqueue(self.store.read_trajectories(1 << 20, pending=True))
        if self._queue:
            log.info("re-reading %d trajectory groups read before the restart and not checkpointed", len(self._queue))
        return len(self._queue)

    def collect(self, policy_version: int, stop_event) -> list | None:
        """rollout_batch_size groups for the learner at `policy_version`, as [(entry id,
        SampleGroup)]; None when `stop_event` is set first."""
        cfg = self.cfg
        want = cfg.rollout_batch_size
        batch: list = []
        uids: set = set()
        self.gen_rates = []
        self.equal = {"dropped": 0, "trained": 0}
        t0 = last_report = time.time()
        while len(batch) < want:
            self.on_progress()
            if stop_event.is_set():
                return None
            if not self._queue:
                self.feeder.replace_dead_letters(policy_version)
                self._enqueue(self.store.read_trajectories(want - len(batch), cfg.replay.block_ms))
                if not self._queue:
                    if time.time() - last_report > 30:
                        last_report = time.time()
                        log.info(
                            "waiting for trajectories: %d/%d groups after %.0fs (prompts queued %d, "
                            "workers %d, generation servers %d)",
                            len(batch),
                            want,
                            time.time() - t0,
                            self.store.prompt_backlog(),
                            len(self.store.live("worker")),
                            len(self.store.live("generation")),
                        )
                    continue
            entry_id, msg, trained = self._queue.popleft()
            group = self._examined(entry_id, msg, trained, policy_version, uids)
            if group is None or self._dropped_equal(entry_id, group, policy_version):
                continue
            self.stale_streak = self._streak_reported = 0
            batch.append((entry_id, group))
            if msg.generate_seconds > 0:
                self.gen_rates.append(msg.batch_tokens / msg.generate_seconds)
            uids.add(msg.task.uid)
        return batch

    def _examined(self, entry_id, msg, trained: bool, policy_version: int, uids: set):
        """The group of a read entry for the learner at `policy_version` (`uids`: the batch's so
        far), or None when it is left out: a duplicate (acknowledged), too stale or ahead (its
        prompt fed again), or malformed (with an error in the log)."""
        cfg = self.cfg
        uid = msg.task.uid
        if trained or uid in uids or uid in self._uncommitted_uids:
            self.store.discard(entry_id)
            self.counters["duplicates"] += 1
            return None
        newest = newest_version(msg)  # a group of several versions is as fresh as its newest tokens
        if policy_version - newest > cfg.max_staleness or newest > policy_version:
            self._refeed(entry_id, msg, policy_version)
            return None
        try:
            group = group_from_proto(msg)
            if cfg.needs_critic and group.values is None:
                raise ValueError(
                    "it has no critic values and this run trains a critic (the worker that wrote it "
                    "runs with another config than the learner's)"
                )
        except ValueError as e:
            log.error("malformed trajectory %s dropped: %s", entry_id, e)
            self.store.discard(entry_id)
            self.counters["malformed"] += 1
            return None
        return group

    def _dropped_equal(self, entry_id, group, policy_version: int) -> bool:
        """With dynamic sampling, a group whose rewards are all equal: dropped, another prompt fed in
        its place, while the batch's bound allows (True); past it, into the batch (False)."""
        cfg = self.cfg
        if not cfg.rollout.dynamic_sampling or informative(group):
            return False
        if self.equal["dropped"] < (cfg.rollout.dynamic_sampling_max_rounds - 1) * cfg.rollout_batch_size:
            self.store.discard(entry_id)
            self.feeder.feed_more(1, policy_version)
            self.equal["dropped"] += 1
            self.counters["dropped_equal"] += 1
            return True
        if not self.equal["trained"]:
            log.warning(
                "dynamic sampling: %d groups whose rewards are all equal dropped for this batch, the bound "
                "of rollout.dynamic_sampling_max_rounds=%d; the next such groups are trained on (they carry "
                "no group-relative advantage: the prompts may be too easy or too hard for the policy)",
                self.equal["dropped"],
                cfg.rollout.dynamic_sampling_max_rounds,
            )
        self.equal["trained"] += 1
        return False

    def _refeed(self, entry_id, msg, policy_version: int) -> None:
        refeed = type(msg.task)()
        refeed.CopyFrom(msg.task)
        refeed.attempt += 1
        refeed.min_version = refeed.fed_at_version = policy_version
        self.store.discard(entry_id, refeed)
        self.counters["dropped_stale"] += 1
        self.stale_streak += 1
        log.debug(
            "dropped group %s from policy version %d (learner at %d, max_staleness %d); fed again",
            msg.task.uid,
            msg.policy_version,
            policy_version,
            self.cfg.max_staleness,
        )
        threshold = 4 * self.cfg.rollout_batch_size
        if self.stale_streak >= max(threshold, 2 * self._streak_reported):
            self._streak_reported = self.stale_streak
            why = (
                "it is AHEAD of the learner: some server serves weights this learner never pushed"
                if msg.policy_version > policy_version
                else "the generation servers do not get the learner's pushes (see 'weight push v' warnings)"
            )
            log.error(
                "stalled: %d trajectory groups in a row dropped as stale, none fresh (newest from policy "
                "version %d, learner at %d, max_staleness %d): %s",
                self.stale_streak,
                msg.policy_version,
                policy_version,
                self.cfg.max_staleness,
                why,
            )

    def trained(self, batch: list) -> None:
        """The batch's update is done: its groups wait for the next checkpoint to be acknowledged."""
        self.uncommitted.extend((e, g.uid) for e, g in batch)
        self._uncommitted_uids.update(g.uid for _, g in batch)
        self.counters["trained_groups"] += len(batch)

    def committed(self) -> None:
        """A checkpoint holding every uncommitted update was written and acknowledged."""
        self.uncommitted, self._uncommitted_uids = [], set()

    def tokens_per_s(self) -> float:
        return sum(self.gen_rates) / max(len(self.gen_rates), 1)


def newest_version(msg) -> int:
    """The newest policy version that sampled a token of a trajectory group (its `policy_version`
    is the oldest; samples whose decoding crossed a weight update name each token's)."""
    return max([msg.policy_version, *(max(s.token_versions) for s in msg.samples if s.token_versions)])
