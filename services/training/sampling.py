"""Single-turn sampling, written once for training and evaluation: a batch of prompts tokenised,
generated (`params.n` samples each), decoded and scored (`generate_and_score`); for training, the
samples valued by the critic and grouped per prompt (`sample_groups`: the rollout workers' and
`train --local`'s step); for the held-out eval, the same scored batch as rows
(evaluate.py: `SingleTurn`). Valuing a response, single-turn or an agent's session, is
`values_of`.

`backend`, `scorer` and `critic` are the domain objects in-process and gRPC clients in a worker or
the learner; both satisfy the same interfaces (`GenerationBackend.generate`, `Scorer.score`,
`ValueFunction.values` in common/types.py).

    generate_and_score    tokenise (prompt_length checked) -> generate -> decode -> score
    sample_groups         that, then values_of (with a critic), as one SampleGroup per prompt
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..common.token_batch import build_token_batch
from ..common.types import GenerationResult, PromptRecord, RewardSample, SampleGroup, SamplingParams, ScoreResult


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
) -> tuple[list[SampleGroup], dict]:
    """One rollout step: `generate_and_score`, then (with a critic) the values, as one group per
    prompt; the step's metrics."""
    batch = generate_and_score(records, backend, scorer, tokenizer, params, prompt_length)
    gen, scored = batch.result, batch.scores
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
    comp_means: dict[str, float] = {}
    for s in scored:
        for name, v in s.components.items():
            comp_means[name] = comp_means.get(name, 0.0) + v / len(scored)
    metrics = {
        "rollout/tokens_per_s": gen.tokens / max(batch.generate_s, 1e-9),
        "rollout/tokens": gen.tokens,
        "time/generate_s": batch.generate_s,
        "time/score_s": batch.score_s,
        "time/values_s": t_values,
        **{f"reward/{name}": v for name, v in comp_means.items()},
    }
    return groups, metrics
