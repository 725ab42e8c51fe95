"""The one seam of sampling for training: a batch of prompts -> per prompt its group (or the
prompt `Rejected`), with the batch's metrics (`Sampled`); or the batch given up (`Failed`: what
a worker does instead). Every sampler has the shape of `GroupSampler`, and each caller chooses
one, once: a rollout worker `ServerSampler` or `AgentSampler` (worker.py), `train --local`
`BackendSampler` or `AgentSampler` (local.py).

    GroupSampler.sample(prompts)    -> Sampled | Failed
      ServerSampler                 one reply per sample, on the generation servers: the tries
                                    (`Tries` under the worker's `RetryPolicy`), one `one_step`
                                    each (training/sampling.py: generate, score, value)
        _OneBatch.generate          the batch's Generate: its deadline, its idempotency key
        partial.py:PartialRollouts  with `rollout.partial_tokens`: the batch decoded in chunks, a
                                    paused response resumed from its tokens (`_OneBatch.part`:
                                    each round a key of its own)
        _Scoring.score              a batch the reward API failed, scored again
        outcomes.classify           a failed try -> another (counted, logged) or the batch given up
      BackendSampler                one reply per sample, on a backend in this process: one
                                    `one_step` (in chunks with `rollout.partial_tokens`)
      agents.py:AgentSampler        each sample a session of the user's agent (`rollout.agent`,
                                    `environment` or `agent_url`)

A Generate call's deadline grows with the work it asks for: `rollout.generate_timeout_s` (default
`rpc.timeout_s`) plus `rollout.generate_timeout_per_token_s` x prompts x n x max_new_tokens. Every
attempt of one batch carries the same idempotency key, so a retry that reaches a server still
working on the batch waits for that work instead of starting it again (the server stops work whose
callers have all left). Decoded in parts, round r >= 1 of a batch has the key `<key>/r` (the same on
every try); a try that fails starts the batch again from round 0.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ..common.replay.records import task_record
from ..common.rpc.retry import DependencyUnavailable
from ..common.servers import Fault, RetryPolicy, ServerPool, Tries
from ..common.types import PromptRecord, SampleGroup, SamplingParams
from ..generation.client import GenerationClient
from ..reward.client import RewardAPIFailure
from ..training.sampling import sample_groups
from .metrics import WorkerMetrics
from .outcomes import Failed, Outcome, Row, ScoringFailed, Then, classify, error_kind, message
from .partial import PartialRollouts

if TYPE_CHECKING:
    from ..common.config import Config

log = logging.getLogger("services.rollout.worker")  # the worker's log lines read as they did in one module


@dataclass(frozen=True)
class Prompt:
    """A prompt to sample a group of: its record, the group's `uid` (epoch:record id), its size
    (0: the config's `num_return_sequences_in_group`) and the oldest policy version that may
    sample it (a prompt fed again after a push asks for that version)."""

    record: PromptRecord
    uid: str
    group_size: int = 0
    min_version: int = 0

    @classmethod
    def of_task(cls, task) -> Prompt:
        """A claimed replay task's prompt."""
        return cls(task_record(task), task.uid, task.group_size, task.min_version)


@dataclass
class Rejected:
    """A prompt whose samples cannot be trained on (an agent's sessions failed on it, or ran longer
    than the learner takes): a worker dead-letters it with `reason`, `train --local` leaves it out;
    the batch's other prompts go on."""

    reason: str


@dataclass
class Sampled:
    """A batch sampled: per prompt (in order) its group or `Rejected`; the batch's metrics
    (time/generate_s, time/score_s, time/values_s, rollout/tokens, ...); the generation server
    that sampled every group, when one did (an agent's turns may each be on another: None)."""

    groups: list[SampleGroup | Rejected]
    metrics: dict
    server: str | None = None


class GroupSampler(Protocol):
    def sample(self, prompts: list[Prompt], score_retries: int | None = None) -> Sampled | Failed:
        """`score_retries`: times a batch the reward API failed is scored again (None:
        `reward.group_retries`; where the reward is a service)."""
        ...

    def close(self) -> None:
        """Once no batch is sampled any more (an agent's sessions in flight finish first)."""
        ...


@dataclass
class BackendSampler:
    """One reply per sample from `backend` in this process (`train --local`), scored by `scorer`,
    valued by `critic` (None: no critic). A failure raises: there is no other server to try."""

    cfg: Config
    backend: object
    scorer: object
    tokenizer: object
    critic: object = None

    def sample(self, prompts: list[Prompt], score_retries: int | None = None) -> Sampled | Failed:
        part = PartialRollouts.part_of(self.backend)
        params = SamplingParams.for_training(self.cfg, prompts[0].group_size or None)
        groups, metrics = one_step(
            self.cfg, prompts, self.backend, part, self.scorer, self.tokenizer, params, self.critic
        )
        return Sampled(list(groups), metrics)

    def close(self) -> None:
        pass


def one_step(cfg: Config, prompts: list[Prompt], generation, part, scorer, tokenizer, params: SamplingParams, critic):
    """One rollout step of `prompts` (training/sampling.py:`sample_groups`) on `generation`, or,
    with `rollout.partial_tokens`, decoded in parts by `part` (partial.py: its metrics added)."""
    partial = cfg.rollout.partial_tokens
    if partial:
        generation = PartialRollouts(part, partial)
    records, uids = [p.record for p in prompts], [p.uid for p in prompts]
    groups, metrics = sample_groups(records, uids, generation, scorer, tokenizer, params, critic, cfg.prompt_length)
    if partial:
        metrics.update(generation.metrics)
    return groups, metrics


def generate_timeout(cfg: Config, n_prompts: int, params: SamplingParams) -> float:
    """The deadline of a Generate call: a base and a budget per token asked for."""
    rc = cfg.rollout
    base = rc.generate_timeout_s if rc.generate_timeout_s is not None else cfg.rpc.timeout_s
    return base + rc.generate_timeout_per_token_s * n_prompts * params.n * params.max_new_tokens


class ServerSampler:
    """One reply per sample, each try of a batch one `sample_groups` call on a generation server
    of `servers` (picked under `retry`), scored by `reward` (a batch the reward API failed is
    scored again), valued by `critic` (None: no critic)."""

    def __init__(
        self,
        cfg: Config,
        tokenizer,
        servers: ServerPool,
        retry: RetryPolicy,
        reward,
        critic,
        stop_event: threading.Event,
        metrics: WorkerMetrics,
    ):
        self.cfg, self.tokenizer, self.servers, self.retry = cfg, tokenizer, servers, retry
        self.reward, self.critic = reward, critic
        self.stop_event, self.metrics = stop_event, metrics

    def sample(self, prompts: list[Prompt], score_retries: int | None = None) -> Sampled | Failed:
        """The batch's tries (one Generate call each) on the servers `self.retry` picks: the
        first that samples it, or the batch given up (every try failed, or one that no other try
        mends)."""
        min_version = max(p.min_version for p in prompts)
        params = SamplingParams.for_training(self.cfg, prompts[0].group_size or None)
        key, timeout = uuid.uuid4().hex, generate_timeout(self.cfg, len(prompts), params)
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
                one = _OneBatch(self.servers.client(address), key, timeout)
                groups, m = one_step(self.cfg, prompts, one, one.part, scoring, self.tokenizer, params, self.critic)
            except Exception as e:
                row = classify(e)
                if row is None:  # no failure the worker knows: the claim loop's to log
                    raise
                self._report(row, e, address, len(prompts), tries.attempt)
                if row.fault is None:  # no other try mends it (a row that tries again has a fault)
                    return Failed(row.then, message(e))
                if row.then is Then.RETRY_LONGER:
                    timeout *= 2  # the server was slower than the budget: the same deadline would fail again
                tries.failed(address, row.fault)
                continue
            if groups and groups[0].policy_version < min_version:  # the server missed a push; it will catch up
                log.info("%s served version %d < %d; trying another", address, groups[0].policy_version, min_version)
                tries.failed(address, Fault.BEHIND)
                continue
            log.debug(
                "batch of %d: generate %.3fs score %.3fs values %.3fs",
                len(prompts),
                m["time/generate_s"],
                m["time/score_s"],
                m["time/values_s"],
            )
            return Sampled(list(groups), m, address)
        return Failed(Then.LEAVE_PENDING)

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
        pass


class _OneBatch:
    """A generation client as `sample_groups` calls it, for the attempts at one batch: each call
    with the batch's deadline and idempotency key. With partial rollouts (partial.py) a batch is
    several calls: `part` r >= 1 (the continuations of round r) has the key `<key>/r` and passes
    `first_prompt_tokens`."""

    def __init__(self, client: GenerationClient, key: str, timeout_s: float):
        self.client, self.key, self.timeout_s = client, key, timeout_s

    def generate(self, prompts, params: SamplingParams):
        return self.client.generate(prompts, params, timeout=self.timeout_s, key=self.key)

    def part(self, prompts, params: SamplingParams, first_prompt_tokens: list[int] | None, part: int):
        """One call of a batch decoded in parts (`PartialRollouts`' `call`)."""
        if part == 0:
            return self.generate(prompts, params)
        return self.client.generate(
            prompts, params, timeout=self.timeout_s, key=f"{self.key}/{part}", first_prompt_tokens=first_prompt_tokens
        )


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
