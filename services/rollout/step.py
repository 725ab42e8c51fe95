"""One rollout step, shared by the in-process trainer and the rollout workers: sample a group of
responses per prompt, score them and value them (GAE). (The held-out eval is
`services.training.evaluate`.)

`backend`, `scorer` and `critic` are the domain objects in-process and gRPC clients in a worker
or the learner; both satisfy the same interfaces (`GenerationBackend.generate`, `Scorer.score`,
`ValueFunction.values` in `types.py`).
"""

from __future__ import annotations

import time

from ..common.modeling import build_token_batch
from ..common.types import PromptRecord, RewardSample, SampleGroup, SamplingParams


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
    """Generate `params.n` samples per prompt, score them and (with a critic) value them."""
    t0 = time.perf_counter()
    prompt_ids = [tokenizer(r.prompt)["input_ids"] for r in records]
    if prompt_length is not None:
        for r, p in zip(records, prompt_ids):
            if len(p) > prompt_length:
                raise ValueError(f"prompt {r.id!r} has {len(p)} tokens, more than prompt_length={prompt_length}")
    gen = backend.generate(prompt_ids, params)
    t_gen = time.perf_counter() - t0
    samples = [
        RewardSample(r.prompt, tokenizer.decode(c.token_ids, skip_special_tokens=True), r.label, r.metadata)
        for r, comps in zip(records, gen.completions)
        for c in comps
    ]
    t1 = time.perf_counter()
    scored = scorer.score(samples)
    t_score = time.perf_counter() - t1
    flat_values = None
    t_values = 0.0
    if critic is not None:
        t2 = time.perf_counter()
        flat_prompts = [p for p, comps in zip(prompt_ids, gen.completions) for _ in comps]
        responses = [c.token_ids for comps in gen.completions for c in comps]
        v = critic.values(build_token_batch(flat_prompts, responses, tokenizer.pad_token_id))
        flat_values = [v[i, : len(r)].tolist() for i, r in enumerate(responses)]
        t_values = time.perf_counter() - t2
    groups, k = [], 0
    for uid, rec, p, comps in zip(uids, records, prompt_ids, gen.completions):
        n = len(comps)
        groups.append(
            SampleGroup(
                uid,
                rec,
                p,
                comps,
                scored[k : k + n],
                flat_values[k : k + n] if flat_values is not None else None,
                gen.policy_version,
            )
        )
        k += n
    comp_means: dict[str, float] = {}
    for s in scored:
        for name, v in s.components.items():
            comp_means[name] = comp_means.get(name, 0.0) + v / len(scored)
    metrics = {
        "rollout/tokens_per_s": gen.tokens / max(t_gen, 1e-9),
        "rollout/tokens": gen.tokens,
        "time/generate_s": t_gen,
        "time/score_s": t_score,
        "time/values_s": t_values,
        **{f"reward/{name}": v for name, v in comp_means.items()},
    }
    return groups, metrics
