"""A rollout worker's single-turn sampler (training/sampling.py's seam: `Sampler`): a batch's
tries over the generation servers, each try a `ReplySampler` on one server.

    ServerSampler.sample(prompts)   -> Sampled | Failed: the tries (`Tries` under the worker's
                                       `RetryPolicy`), one `ReplySampler.sample` each
      _OneBatch.generate            the batch's Generate: its deadline, its idempotency key
      _OneBatch.part                with `rollout.partial_tokens`: each round of a batch decoded in
                                    parts a key of its own (training/partial.py)
      _Scoring.score                a batch the reward API failed, scored again
      outcomes.classify             a failed try -> another (counted, logged) or the batch given up

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
from typing import TYPE_CHECKING

from ..common.rpc.retry import DependencyUnavailable
from ..common.servers import Fault, RetryPolicy, ServerPool, Tries
from ..common.types import SampleGroup, SamplingParams
from ..generation.client import GenerationClient
from ..reward.client import RewardAPIFailure
from ..training.distill import Distillation
from ..training.sampling import Failed, Prompt, ReplySampler, Sampled, Then
from .metrics import WorkerMetrics
from .outcomes import Outcome, Row, ScoringFailed, classify, error_kind, message

if TYPE_CHECKING:
    from ..common.config import Config

log = logging.getLogger("services.rollout.worker")  # the worker's log lines read as they did in one module


def generate_timeout(cfg: Config, n_prompts: int, params: SamplingParams) -> float:
    """The deadline of a Generate call: a base and a budget per token asked for."""
    rc = cfg.rollout
    base = rc.generate_timeout_s if rc.generate_timeout_s is not None else cfg.rpc.timeout_s
    return base + rc.generate_timeout_per_token_s * n_prompts * params.n * params.max_new_tokens


class ServerSampler:
    """One reply per sample, each try of a batch a `ReplySampler` on a generation server of
    `servers` (picked under `retry`), scored by `reward` (a batch the reward API failed is
    scored again), valued by `critic` (None: no critic), read by the teacher with `distill`."""

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
        distill: Distillation | None = None,
    ):
        self.cfg, self.tokenizer, self.servers, self.retry = cfg, tokenizer, servers, retry
        self.reward, self.critic, self.distill = reward, critic, distill
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
            one = _OneBatch(self.servers.client(address), key, timeout)
            reply = ReplySampler.for_training(
                self.cfg, one, scoring, self.tokenizer, self.critic, one.part, self.distill
            )
            try:
                sampled = reply.sample(prompts)
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
            version = min(g.policy_version for g in sampled.groups if isinstance(g, SampleGroup))
            if version < min_version:  # the server missed a push; it will catch up
                log.info("%s served version %d < %d; trying another", address, version, min_version)
                tries.failed(address, Fault.BEHIND)
                continue
            m = sampled.metrics
            log.debug(
                "batch of %d: generate %.3fs score %.3fs values %.3fs",
                len(prompts),
                m["time/generate_s"],
                m["time/score_s"],
                m["time/values_s"],
            )
            sampled.server = address
            return sampled
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

    def score(self, sequences, starts):
        """ScoreTokens on the server that sampled the batch (the policy as teacher: distill.py)."""
        return self.client.score_tokens(sequences, starts, timeout=self.timeout_s)

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
