"""What becomes of a claimed batch: sampled (`sampling.py`), its groups appended to the
trajectories and its prompts acknowledged in one atomic step per prompt (`ReplayStore.produce`);
or, when the sampling came to no groups (`outcomes.Failed`), what its `Then` says: left pending,
split to find the prompt at fault and dead-letter it, split to score each prompt alone and drop
the group the reward API still fails, or the worker stopped. Each batch, and each prompt of one
that was split, ends as a `Fate`.

    Batches.settle         sample (`Sampler.sample`), then append (a `Rejected` prompt dead-lettered)
      _stop                the user's reward function failed: the worker stops, the run with it
      _refused             a prompt refused: each prompt alone; the one refused dead-lettered
      _unscored            the reward API failed the batch: `_isolate`, each prompt scored alone
"""

from __future__ import annotations

import enum
import logging
import threading
import time

from ..common.replay import ReplayStore
from ..common.replay.records import group_to_proto
from ..training.sampling import Failed, Prompt, Rejected, Sampled, Sampler, Then
from .metrics import WorkerMetrics

log = logging.getLogger("services.rollout.worker")  # the worker's log lines read as they did in one module


class Fate(enum.Enum):
    """What became of a batch, or of one prompt of a batch that was split."""

    SCORED = enum.auto()  # its groups appended (or there already; a split batch: settled prompt by prompt)
    REJECTED = enum.auto()  # dead-lettered: a server refused the prompt
    UNSCORED = enum.auto()  # the reward API gave its group no reward; left pending (not `drop`)
    DROPPED = enum.auto()  # that, and dropped: dead-lettered (the learner feeds a replacement)
    PENDING = enum.auto()  # given up on for now (or the worker stops): left pending, reclaimed later


class Batches:
    """Claimed batches settled: each sampled by `sampler` (the worker's choice of `Sampler`),
    appended to `store` as worker `name`, or dead-lettered, dropped or left
    pending as the sampling's `Failed` says. `produced`: the groups appended; `failure`: why the
    run cannot go on (the user's reward function failed), once it cannot."""

    def __init__(
        self,
        store: ReplayStore,
        name: str,
        sampler: Sampler,
        stop_event: threading.Event,
        metrics: WorkerMetrics,
    ):
        self.store, self.name, self.sampler = store, name, sampler
        self.stop_event, self.metrics = stop_event, metrics
        self._lock = threading.Lock()
        self.produced = 0
        self.failure: str | None = None

    def process(self, entries: list) -> int:
        """Sample, append and acknowledge one claimed batch. Returns groups appended."""
        return self.settle(entries)[0]

    def settle(self, entries: list, score_retries: int | None = None, drop: bool = True) -> tuple[int, Fate]:
        """`process` with `score_retries` (None: reward.group_retries), and a group the reward API
        gave no reward left pending (`Fate.UNSCORED`) unless `drop`. Returns the groups appended
        and what became of the batch."""
        t0 = time.perf_counter()
        sampled = self.sampler.sample([Prompt.of_task(t) for _, t in entries], score_retries)
        if not isinstance(sampled, Failed):
            return self._append(entries, sampled, t0), Fate.SCORED
        if sampled.then is Then.STOP:
            return self._stop(sampled.why)
        if sampled.then is Then.DEAD_LETTER:
            return self._refused(entries, sampled.why, score_retries)
        if sampled.then is Then.DROP_UNSCORED:
            return self._unscored(entries, sampled.why, drop)
        log.error("giving up on a batch of %d prompts for now; they stay pending and will be reclaimed", len(entries))
        return 0, Fate.PENDING

    def _append(self, entries: list, sampled: Sampled, t0: float) -> int:
        """The sampled groups appended and their prompts acknowledged; a `Rejected` prompt (an
        agent's sessions failed on it) dead-lettered alone. Returns groups appended."""
        kept = []
        for (entry_id, task), group in zip(entries, sampled.groups):
            if isinstance(group, Rejected):
                log.error("prompt %s cannot be processed, moved to the dead-letter stream: %s", task.uid, group.reason)
                self._dead_letter(entry_id, task, group.reason)
            else:
                kept.append((entry_id, task, group))
        secs = time.perf_counter() - t0
        m = sampled.metrics
        generate_s, tokens = m["time/generate_s"], int(m["rollout/tokens"])
        added = self.store.produce(
            [
                (entry_id, group_to_proto(group, task, self.name, sampled.server or "", generate_s, tokens))
                for entry_id, task, group in kept
            ]
        )
        appended = sum(added)
        self.metrics.duplicates.inc(len(added) - appended)
        self.metrics.produced.inc(appended)
        self.metrics.batch_seconds.observe(time.perf_counter() - t0)
        log.debug("batch of %d appended in %.3fs (sampling %.3fs)", len(kept), time.perf_counter() - t0, secs)
        with self._lock:
            self.produced += appended
        return appended

    def _stop(self, why: str) -> tuple[int, Fate]:
        """A bug in the user's code: no prompt is to blame, the run stops."""
        log.error(
            "the reward function failed; this worker stops, and `rlhf up` stops the run (the prompts "
            "stay pending):\n%s",
            why,
        )
        self.failure = why
        self.stop_event.set()
        return 0, Fate.PENDING

    def _refused(self, entries: list, why: str, score_retries: int | None) -> tuple[int, Fate]:
        """The request itself is bad: the prompts that cause it isolated, each dead-lettered."""
        if len(entries) > 1:
            return sum(self.settle([e1], score_retries)[0] for e1 in entries), Fate.SCORED
        entry_id, task = entries[0]
        log.error("prompt %s cannot be processed, moved to the dead-letter stream: %s", task.uid, why)
        self._dead_letter(entry_id, task, why)
        return 0, Fate.REJECTED

    def _unscored(self, entries: list, why: str, drop: bool) -> tuple[int, Fate]:
        """The reward API failed the batch on every try: a batch split (`_isolate`), one prompt's
        group dropped (when `drop`)."""
        if len(entries) > 1:
            return self._isolate(entries, why), Fate.SCORED
        entry_id, task = entries[0]
        if not drop:
            return 0, Fate.UNSCORED
        log.error(
            "prompt %s: the reward API gave its group no reward on every try; the group is dropped "
            "(moved to the dead-letter stream, the learner feeds a replacement): %s",
            task.uid,
            why,
        )
        self._dead_letter(entry_id, task, f"reward API: {why}")
        self.metrics.dropped.inc()
        return 0, Fate.DROPPED

    def _isolate(self, entries: list, why: str) -> int:
        """After the reward API failed a batch on every try: each prompt alone, sampled and scored
        once more. A prompt whose group it still fails is dropped only once the API has scored
        another of these prompts (then the failure is that input's; one that failed before gets one
        more try first); if it scores none, it fails everything (an outage, not an input), and the
        prompts stay pending for a later try. Returns groups appended."""
        log.error(
            "the reward API failed a batch of %d prompts on every try (%s); trying each prompt alone",
            len(entries),
            why,
        )
        appended, waiting, works = 0, [], False
        for i, entry in enumerate(entries):
            n, fate = self.settle([entry], 0, drop=works)
            appended += n
            if fate is Fate.UNSCORED:
                waiting.append(entry)
            elif fate in (Fate.SCORED, Fate.REJECTED) and not works:
                works = True  # the API answers: the prompts that failed before get one more try
                appended += sum(self.settle([w], 0, drop=True)[0] for w in waiting)
                waiting = []
            elif fate is Fate.PENDING:  # the reward server or its API down (breaker open) past the wait
                log.error(
                    "the reward API is down: the %d prompts not tried alone yet stay pending", len(entries) - i - 1
                )
                break
        if waiting:
            self.metrics.error("reward_api").inc()
            log.error(
                "the reward API scored none of %d prompts alone either: it fails every request, not one "
                "input; they stay pending and are tried again later",
                len(waiting),
            )
        return appended

    def _dead_letter(self, entry_id, task, reason: str) -> None:
        self.store.dead_letter(entry_id, task, reason, self.name)
        self.metrics.dead.inc()
