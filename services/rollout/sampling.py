"""One claimed batch sampled: its prompts -> their groups, each sample generated, scored and
valued (`step.py:sample_groups`); or, with `rollout.agent` (or `environment`, `agent_url`), each
sample a session of the user's agent (`agents.py:AgentSampling`). A failed try is looked up in
the outcomes table (`outcomes.py`): another try, or the batch given up with what the worker does
instead (`Failed`: leave it pending, dead-letter a prompt, drop a group the reward API fails, stop).

    Sampler.sample                  the agent's sessions, or:
      Sampler._single_turn          the tries over the generation servers (`Tries` under the
                                    worker's `RetryPolicy`), one `sample_groups` call each
        _OneBatch.generate          the batch's Generate: its deadline, its idempotency key
        _Scoring.score              a batch the reward API failed, scored again
        outcomes.classify           a failed try -> another (counted, logged) or the batch given up

A Generate call's deadline grows with the work it asks for: `rollout.generate_timeout_s` (default
`rpc.timeout_s`) plus `rollout.generate_timeout_per_token_s` x prompts x n x max_new_tokens. Every
attempt of one batch carries the same idempotency key, so a retry that reaches a server still
working on the batch waits for that work instead of starting it again (the server stops work whose
callers have all left).
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import TYPE_CHECKING

from ..common.replay.records import task_record
from ..common.rpc.retry import DependencyUnavailable
from ..common.servers import Fault, RetryPolicy, ServerPool, Tries
from ..common.types import SamplingParams
from ..generation.client import GenerationClient
from ..reward.client import RewardAPIFailure
from .agents import AgentSampling
from .metrics import WorkerMetrics
from .outcomes import Failed, Outcome, Row, ScoringFailed, Then, classify, error_kind, message
from .step import sample_groups

if TYPE_CHECKING:
    from ..common.config import Config

log = logging.getLogger("services.rollout.worker")  # the worker's log lines read as they did in one module


class Sampler:
    """A worker's batches sampled. With `agents`, each sample is a session of the user's agent;
    else each try of a batch is one `sample_groups` call on a generation server of `servers`
    (picked under `retry`), scored by `reward` (a batch the reward API failed is scored again),
    valued by `critic` (None: no critic)."""

    def __init__(
        self,
        cfg: Config,
        tokenizer,
        servers: ServerPool,
        retry: RetryPolicy,
        reward,
        critic,
        agents: AgentSampling | None,
        stop_event: threading.Event,
        metrics: WorkerMetrics,
    ):
        self.cfg, self.tokenizer, self.servers, self.retry = cfg, tokenizer, servers, retry
        self.reward, self.critic, self.agents = reward, critic, agents
        self.stop_event, self.metrics = stop_event, metrics

    def sample(self, tasks: list, score_retries: int | None = None) -> list | Failed:
        """Per task (group, generation server, metrics), or `Rejected` (an agent's sessions failed
        on it); or `Failed`: the batch came to no groups, and what the worker does instead.
        `score_retries`: times a batch the reward API failed is scored again (None:
        `reward.group_retries`; a single-turn batch only)."""
        if self.agents is not None:
            return self._sessions(self.agents, tasks)
        return self._single_turn(tasks, score_retries)

    def _sessions(self, agents: AgentSampling, tasks: list) -> list | Failed:
        try:
            groups = agents.sample(tasks)
        except ValueError as e:  # a prompt at fault, as in a single-turn batch
            row = classify(e)
            if row is None:
                raise
            return Failed(row.then, message(e))
        return Failed(Then.LEAVE_PENDING) if groups is None else groups

    def _single_turn(self, tasks: list, score_retries: int | None) -> list | Failed:
        """The batch's tries (one Generate call each) on the servers `self.retry` picks: the
        first that samples it, or the batch given up (every try failed, or one that no other try
        mends)."""
        min_version = max(t.min_version for t in tasks)
        params = SamplingParams.for_training(self.cfg, tasks[0].group_size or None)
        key, timeout = uuid.uuid4().hex, self.generate_timeout(len(tasks), params)
        retries = self.cfg.reward.group_retries if score_retries is None else score_retries
        scoring = _Scoring(self.reward, retries, self.cfg.reward.group_retry_wait_s, self.stop_event, self.metrics)
        tries = Tries(self.servers, self.retry, min_version, self.stop_event)
        for address in tries:
            if self.stop_event.is_set() and tries.attempt:
                return Failed(Then.LEAVE_PENDING)
            if address is None:
                self.metrics.error("no_generation_server").inc()
                log.info("no live generation server registered; waiting %.1fs", tries.backoff_s)
                tries.failed(None)
                continue
            try:
                generation = _OneBatch(self.servers.client(address), key, timeout)
                groups, m = sample_groups(
                    [task_record(t) for t in tasks],
                    [t.uid for t in tasks],
                    generation,
                    scoring,
                    self.tokenizer,
                    params,
                    self.critic,
                    self.cfg.prompt_length,
                )
            except Exception as e:
                row = classify(e)
                if row is None:  # no failure the worker knows: the claim loop's to log
                    raise
                self._report(row, e, address, len(tasks), tries.attempt)
                if row.fault is None:  # no other try mends it (a row that tries again has a fault)
                    return Failed(row.then, message(e))
                if row.then is Then.RETRY_LONGER:
                    timeout *= 2  # the server was slower than the budget: the same deadline would fail again
                tries.failed(address, row.fault)
                continue
            if groups and groups[0].version < min_version:  # the server missed a push; it will catch up
                log.info("%s served version %d < %d; trying another", address, groups[0].version, min_version)
                tries.failed(address, Fault.BEHIND)
                continue
            log.debug(
                "batch of %d: generate %.3fs score %.3fs values %.3fs",
                len(tasks),
                m["time/generate_s"],
                m["time/score_s"],
                m["time/values_s"],
            )
            return [(g, address, m) for g in groups]
        return Failed(Then.LEAVE_PENDING)

    def generate_timeout(self, n_prompts: int, params: SamplingParams) -> float:
        """The deadline of a Generate call: a base and a budget per token asked for."""
        rc = self.cfg.rollout
        base = rc.generate_timeout_s if rc.generate_timeout_s is not None else self.cfg.rpc.timeout_s
        return base + rc.generate_timeout_per_token_s * n_prompts * params.n * params.max_new_tokens

    def _report(self, row: Row, e, address: str, n_prompts: int, attempt: int) -> None:
        """A failed try of a batch on `address`: counted, when its row says so, and logged (what
        the worker does with the batch then is logged where it does it)."""
        if row.counted:
            self.metrics.error(error_kind(e)).inc()
        retries = self.cfg.rollout.retries
        if row.outcome is Outcome.DEPENDENCY_GONE:  # reward or critic gone for longer than we wait
            log.error("batch of %d prompts left pending: %s", n_prompts, e)
        elif row.outcome is Outcome.OTHER_SERVER_FAILED:
            log.warning(
                "batch of %d prompts: the %s server answered %s (%s); retry %d/%d",
                n_prompts,
                getattr(e, "service", "generation"),
                e.code().name,
                e.details(),
                attempt + 1,
                retries,
            )
        elif row.outcome is Outcome.REQUEST_REFUSED:
            log.error(
                "generation server %s refuses the request itself (%s): its limits differ from this "
                "worker's config; trying another",
                address,
                e.details(),
            )
        elif row.tries_again:  # the generation server failed it, or was slower than the deadline
            log.warning(
                "batch of %d prompts failed on %s (%s: %s); retry %d/%d",
                n_prompts,
                address,
                e.code().name,
                e.details(),
                attempt + 1,
                retries,
            )

    def close(self) -> None:
        """The agents' endpoint, once the worker's loops have ended (the sessions in flight finish
        first)."""
        if self.agents is not None:
            self.agents.close()
            self.agents = None


class _OneBatch:
    """A generation client as `sample_groups` calls it, for the attempts at one batch: each call
    with the batch's deadline and idempotency key."""

    def __init__(self, client: GenerationClient, key: str, timeout_s: float):
        self.client, self.key, self.timeout_s = client, key, timeout_s

    def generate(self, prompts, params: SamplingParams):
        return self.client.generate(prompts, params, timeout=self.timeout_s, key=self.key)


class _Scoring:
    """The reward server as `sample_groups` calls it in a worker: a batch the reward API failed
    (`RewardAPIFailure`) is scored again `retries` times, `wait_s` apart (the samples are kept:
    nothing is generated again), then `ScoringFailed`. A stopping worker raises
    `DependencyUnavailable` instead (the batch stays pending)."""

    def __init__(self, reward, retries: int, wait_s: float, stop_event: threading.Event, metrics: WorkerMetrics):
        self.reward, self.retries, self.wait_s = reward, retries, wait_s
        self.stop_event, self.metrics = stop_event, metrics

    def score(self, samples):
        for attempt in range(self.retries + 1):
            try:
                return self.reward.score(samples)
            except RewardAPIFailure as e:
                error = e
            if self.stop_event.is_set():
                raise DependencyUnavailable(f"stopping; the reward API failed the batch: {error}")
            if attempt < self.retries:
                self.metrics.score_retries.inc()
                log.warning(
                    "the reward API failed a batch of %d samples (%s); scoring it again in %.1fs (%d/%d)",
                    len(samples),
                    error,
                    self.wait_s,
                    attempt + 1,
                    self.retries,
                )
                self.stop_event.wait(self.wait_s)
        raise ScoringFailed(str(error))
