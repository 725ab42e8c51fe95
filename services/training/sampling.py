"""The one seam of sampling, for training and evaluation, single-turn and agent: a batch of prompts
-> `Sampled` (per prompt its group, or the prompt `Rejected`; the batch's metrics; every sample as
an eval row) or the batch given up (`Failed`). Every sampler has the shape of `Sampler`, and each
caller chooses one, once:

    Sampler.sample(prompts)     -> Sampled | Failed
      ReplySampler              one reply per sample from one backend (in the process, or one
                                generation server's client): `sample_groups`, in parts with
                                `partial_tokens` (partial.py: PartialRollouts wrapped here, once)
        generate_and_score      tokenise (prompt_length checked) -> generate -> decode -> score
        values_of               the critic's value of each response token (an agent's sessions
                                are valued by it too)
        Distillation.read       on-policy distillation: the teacher's log-prob of each response
                                token (distill.py; an agent's sessions are read by it too)
      rollout/sampling.py:ServerSampler    a rollout worker's: tries over the generation servers,
                                           each try a ReplySampler on one server
      agents/sampler.py:AgentSampler       each sample a session of the user's agent

    training: `train --local` (local.py) and a rollout worker (rollout/worker.py) read the groups
    evaluation: evaluate.py:Evaluator reads the rows

`backend`, `scorer` and `critic` are the domain objects in-process and gRPC clients in a worker or
the learner; both satisfy the same interfaces (`GenerationBackend.generate`, `Scorer.score`,
`ValueFunction.values` in common/types.py).

A row (evaluate.py writes them): {"id", "prompt", "response", "label", "reward", "components",
"sample"} (`sample`: 0..n-1, the samples of one prompt), and `proxy_reward` when a proxy scores
them too; an agent's session adds its conversation (agents/evaluate.py).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from ..common.replay.records import task_record
from ..common.token_batch import build_token_batch
from ..common.types import GenerationResult, PromptRecord, RewardSample, SampleGroup, SamplingParams, ScoreResult
from .dapo import shaped
from .distill import Distillation
from .partial import PartialRollouts

if TYPE_CHECKING:
    from ..common.config import Config


@dataclass(frozen=True)
class Prompt:
    """A prompt to sample a group of: its record, the group's `uid` (epoch:record id), its size
    (0: the sampler's own) and the oldest policy version that may sample it (a prompt fed again
    after a push asks for that version)."""

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
    (time/generate_s, time/score_s, time/values_s, rollout/tokens, ...); every sample as an eval
    row, prompt-major (a rejected prompt's samples too: an eval scores what the policy does); the
    generation server that sampled every group, when one did (an agent's turns may each be on
    another: None)."""

    groups: list[SampleGroup | Rejected]
    metrics: dict
    rows: list[dict] = field(default_factory=list)
    server: str | None = None


class Then(enum.Enum):
    """What the caller does about a batch that came to no groups (a worker: rollout/outcomes.py's
    table; `train --local` stops; an eval raises the cause)."""

    RETRY = enum.auto()  # another try (the generation server avoided as the row's `Fault` says)
    RETRY_LONGER = enum.auto()  # that, with twice the deadline (the same one would pass again)
    LEAVE_PENDING = enum.auto()  # give the batch up for now: its prompts stay pending, reclaimed later
    DEAD_LETTER = enum.auto()  # split the batch to find the prompt at fault; dead-letter it alone
    DROP_UNSCORED = enum.auto()  # split the batch, each prompt scored alone; drop a group the API still fails
    STOP = enum.auto()  # stop the worker, and with it the run (the prompts stay pending)


@dataclass(frozen=True)
class Failed:
    """Sampling a batch came to no groups: what the caller does now (`then`) and the error's
    message (`why`); `cause`, the error itself, when one was raised."""

    then: Then
    why: str = ""
    cause: BaseException | None = field(default=None, compare=False)


class Sampler(Protocol):
    def sample(self, prompts: list[Prompt], score_retries: int | None = None) -> Sampled | Failed:
        """`score_retries`: times a batch the reward API failed is scored again (None:
        `reward.group_retries`; where the reward is a service)."""
        ...

    def close(self) -> None:
        """Once no batch is sampled any more (an agent's sessions in flight finish first)."""
        ...


@dataclass
class ReplySampler:
    """One reply per sample from `backend`, `params.n` per prompt (a prompt's `group_size`, when it
    has one), scored by `scorer`, valued by `critic` (None: no critic); with `partial_tokens`,
    decoded in parts, each part a call of `part` (None: the backend's `generate`). A prompt over
    `prompt_length` tokens is refused (None: not checked). `proxy`: the training reward, when the
    held-out one is a gold reward apart (`reward.eval_rules`): each row's `proxy_reward`, so a
    policy that pleases the proxy but not the gold shows. `overlong`: (buffer, penalty) of DAPO's
    soft overlong punishment (dapo.py), added to each training reward. A failure raises: the
    caller knows what it means."""

    backend: Any
    scorer: Any
    tokenizer: Any
    params: SamplingParams
    critic: Any = None
    prompt_length: int | None = None
    partial_tokens: int = 0
    part: Any = None
    proxy: Any = None
    overlong: tuple[int, float] = (0, 0.0)
    distill: Distillation | None = None

    @classmethod
    def for_training(
        cls, cfg: Config, backend, scorer, tokenizer, critic, part=None, distill: Distillation | None = None
    ) -> ReplySampler:
        """Training's: the config's sampling, prompts checked against prompt_length, partial
        rollouts (`rollout.partial_tokens`, each part a call of `part`), the overlong punishment,
        the teacher's reading of each sampled token (`distill`, distill.py; None: none)."""
        params = SamplingParams.for_training(cfg)
        overlong = (cfg.reward.overlong_buffer, cfg.reward.overlong_penalty)
        return cls(backend, scorer, tokenizer, params, critic, cfg.prompt_length, cfg.rollout.partial_tokens, part,
                   overlong=overlong, distill=distill)  # fmt: skip

    def sample(self, prompts: list[Prompt], score_retries: int | None = None) -> Sampled:
        params = replace(self.params, n=prompts[0].group_size) if prompts[0].group_size else self.params
        generation = self.backend
        if self.partial_tokens:
            generation = PartialRollouts(self.part or PartialRollouts.part_of(self.backend), self.partial_tokens)
        records, uids = [p.record for p in prompts], [p.uid for p in prompts]
        groups, metrics, batch = sample_groups(
            records, uids, generation, self.scorer, self.tokenizer, params, self.critic, self.prompt_length,
            self.overlong,
        )  # fmt: skip
        if self.partial_tokens:
            metrics.update(generation.metrics)
        if self.distill is not None:
            metrics.update(self.distill.read(groups, self.backend))
        return Sampled(list(groups), metrics, reply_rows(records, batch, self.proxy))

    def close(self) -> None:
        pass


@dataclass
class ScoredBatch:
    """A batch generated and scored: per prompt its token ids; the generation's result; every
    sample (prompt-major: a prompt's `params.n` samples one after the other) as the scorer saw it
    (`samples`, the decoded response in each) and its score; the seconds each part took."""

    prompt_ids: list[list[int]]
    result: GenerationResult
    samples: list[RewardSample]
    scores: list[ScoreResult]
    generate_s: float
    score_s: float


def generate_and_score(
    records: list[PromptRecord], backend, scorer, tokenizer, params: SamplingParams, prompt_length: int | None = None
) -> ScoredBatch:
    """Generate `params.n` samples per prompt, decode them (special tokens skipped) and score them.
    `prompt_length`: a prompt of more tokens is refused (ValueError naming it)."""
    t0 = time.perf_counter()
    prompt_ids = [tokenizer(r.prompt)["input_ids"] for r in records]
    if prompt_length is not None:
        for r, p in zip(records, prompt_ids):
            if len(p) > prompt_length:
                raise ValueError(f"prompt {r.id!r} has {len(p)} tokens, more than prompt_length={prompt_length}")
    result = backend.generate(prompt_ids, params)
    t_gen = time.perf_counter() - t0
    samples = [
        RewardSample(r.prompt, tokenizer.decode(c.token_ids, skip_special_tokens=True), r.label, r.metadata)
        for r, comps in zip(records, result.completions)
        for c in comps
    ]
    t1 = time.perf_counter()
    scores = scorer.score(samples)
    return ScoredBatch(prompt_ids, result, samples, scores, t_gen, time.perf_counter() - t1)


def values_of(critic, tokenizer, prompt_ids: list[list[int]], responses: list[list[int]]) -> list[list[float]]:
    """The critic's value of each response token (`prompt_ids[i]` + `responses[i]`, one batch)."""
    v = critic.values(build_token_batch(prompt_ids, responses, tokenizer.pad_token_id))
    return [v[i, : len(r)].tolist() for i, r in enumerate(responses)]


def sample_groups(
    records: list[PromptRecord],
    uids: list[str],
    backend,
    scorer,
    tokenizer,
    params: SamplingParams,
    critic=None,
    prompt_length: int | None = None,
    overlong: tuple[int, float] = (0, 0.0),
) -> tuple[list[SampleGroup], dict, ScoredBatch]:
    """One rollout step: `generate_and_score`, the overlong punishment (`overlong`: its buffer and
    penalty; dapo.py) added to each reward, then (with a critic) the values, as one group per
    prompt; the step's metrics; the scored batch."""
    batch = generate_and_score(records, backend, scorer, tokenizer, params, prompt_length)
    gen = batch.result
    lengths = [len(c.token_ids) for comps in gen.completions for c in comps]
    scored = shaped(batch.scores, lengths, params.max_new_tokens, *overlong)
    flat_values = None
    t_values = 0.0
    if critic is not None:
        t2 = time.perf_counter()
        flat_prompts = [p for p, comps in zip(batch.prompt_ids, gen.completions) for _ in comps]
        flat_values = values_of(
            critic, tokenizer, flat_prompts, [c.token_ids for comps in gen.completions for c in comps]
        )
        t_values = time.perf_counter() - t2
    groups, k = [], 0
    for uid, rec, p, comps in zip(uids, records, batch.prompt_ids, gen.completions):
        n = len(comps)
        values = flat_values[k : k + n] if flat_values is not None else None
        groups.append(SampleGroup(uid, rec, p, comps, scored[k : k + n], values, gen.policy_version))
        k += n
    metrics = {
        "rollout/tokens_per_s": gen.tokens / max(batch.generate_s, 1e-9),
        "rollout/tokens": gen.tokens,
        "time/generate_s": batch.generate_s,
        "time/score_s": batch.score_s,
        "time/values_s": t_values,
        **component_means(scored),
    }
    return groups, metrics, batch


def component_means(scores: list[ScoreResult]) -> dict[str, float]:
    """`reward/<name>`: the mean of each reward component over `scores` (a rule's parts, an agent's
    reward and a verifiers rubric's functions alike)."""
    means: dict[str, float] = {}
    for s in scores:
        for name, v in s.components.items():
            means[name] = means.get(name, 0.0) + v / len(scores)
    return {f"reward/{name}": v for name, v in means.items()}


def reply_rows(records: list[PromptRecord], batch: ScoredBatch, proxy=None) -> list[dict]:
    """Every sample of a scored batch as a row, prompt-major; scored by `proxy` too when given."""
    rows, k = [], 0
    for r, comps in zip(records, batch.result.completions):
        for j in range(len(comps)):
            score = batch.scores[k]
            rows.append(
                {
                    "id": r.id,
                    "prompt": r.prompt,
                    "response": batch.samples[k].response,
                    "label": r.label,
                    "reward": score.reward,
                    "components": dict(score.components),
                    "sample": j,
                }
            )
            k += 1
    if proxy is not None and rows:
        for row, s in zip(rows, proxy.score(batch.samples)):
            row["proxy_reward"] = s.reward
    return rows
