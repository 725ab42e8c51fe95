"""One rollout step, shared by the in-process trainer and the rollout workers: sample a group of
responses per prompt, score them, value them (GAE), and turn groups into the learner's `Rollout`.

`backend`, `scorer` and `critic` are the domain objects in-process and gRPC clients in a worker;
both satisfy the same interfaces (`generate`, `score`, `values`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from ..common.data import PromptRecord
from ..common.modeling import build_token_batch
from ..generation.backend import Completion, SamplingParams
from ..learner.ppo_step import Rollout
from ..reward.scorer import RewardSample, ScoreResult


def train_params(cfg, n: int | None = None) -> SamplingParams:
    """Sampling for training rollouts: the group size and the configured temperature/top-p/top-k."""
    g = cfg.generation
    return SamplingParams(n=n or cfg.num_return_sequences_in_group, temperature=g.temperature, top_p=g.top_p,
                          top_k=g.top_k, max_new_tokens=cfg.response_length)


def eval_params(cfg) -> SamplingParams:
    """Sampling for the held-out eval: one sample per prompt at eval_temperature (0 = greedy), seeded."""
    g = cfg.generation
    return SamplingParams(n=1, temperature=g.eval_temperature, top_p=g.top_p, top_k=g.top_k,
                          max_new_tokens=cfg.response_length, seed=cfg.run.seed)


@dataclass
class SampleGroup:
    """The samples of one prompt, all from one policy version."""
    uid: str  # the prompt's id within its epoch; samples of a group share it (GRPO/RLOO groups)
    record: PromptRecord
    prompt_ids: list[int]
    completions: list[Completion]
    scores: list[ScoreResult]
    values: list[list[float]] | None  # per sample, one value per response token
    version: int


def sample_groups(records: list[PromptRecord], uids: list[str], backend, scorer, tokenizer, params: SamplingParams,
                  critic=None, prompt_length: int | None = None) -> tuple[list[SampleGroup], dict]:
    """Generate `params.n` samples per prompt, score them and (with a critic) value them."""
    t0 = time.perf_counter()
    prompt_ids = [tokenizer(r.prompt)["input_ids"] for r in records]
    if prompt_length is not None:
        for r, p in zip(records, prompt_ids):
            if len(p) > prompt_length:
                raise ValueError(f"prompt {r.id!r} has {len(p)} tokens, more than prompt_length={prompt_length}")
    gen = backend.generate(prompt_ids, params)
    t_gen = time.perf_counter() - t0
    samples = [RewardSample(r.prompt, tokenizer.decode(c.token_ids, skip_special_tokens=True), r.label, r.metadata)
               for r, comps in zip(records, gen.completions) for c in comps]
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
        flat_values = [v[i, :len(r)].tolist() for i, r in enumerate(responses)]
        t_values = time.perf_counter() - t2
    groups, k = [], 0
    for uid, rec, p, comps in zip(uids, records, prompt_ids, gen.completions):
        n = len(comps)
        groups.append(SampleGroup(uid, rec, p, comps, scored[k:k + n],
                                  flat_values[k:k + n] if flat_values is not None else None, gen.policy_version))
        k += n
    comp_means: dict[str, float] = {}
    for s in scored:
        for name, v in s.components.items():
            comp_means[name] = comp_means.get(name, 0.0) + v / len(scored)
    metrics = {"rollout/tokens_per_s": gen.tokens / max(t_gen, 1e-9), "rollout/tokens": gen.tokens,
               "time/generate_s": t_gen, "time/score_s": t_score, "time/values_s": t_values,
               **{f"reward/{name}": v for name, v in comp_means.items()}}
    return groups, metrics


def groups_to_rollout(groups: list[SampleGroup]) -> Rollout:
    """Flatten groups into the learner's batch: B = prompts x samples per prompt."""
    prompt_ids, responses, scores, index, logps, versions, values = [], [], [], [], [], [], []
    for g in groups:
        for j, c in enumerate(g.completions):
            prompt_ids.append(g.prompt_ids)
            responses.append(c.token_ids)
            logps.append(c.log_probs)
            scores.append(g.scores[j].reward)
            index.append(g.uid)
            versions.append(g.version)
            if g.values is not None:
                values.append(g.values[j])
    value_tensor = None
    if groups and groups[0].values is not None:
        width = max(len(r) for r in responses)
        arr = np.zeros((len(values), width), dtype=np.float32)
        for i, v in enumerate(values):
            arr[i, :len(v)] = v
        value_tensor = torch.from_numpy(arr)
    return Rollout(prompt_ids, responses, scores, index, logps, value_tensor, versions)
