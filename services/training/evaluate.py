"""The held-out eval of the training loop, in-process (the generation backend and the scorer)
or in the learner service (a generation server serving the current version and the reward
server's held-out scorer): both satisfy `GenerationBackend.generate` and `Scorer.score`."""
from __future__ import annotations

from ..common.types import PromptRecord, RewardSample, SamplingParams


def evaluate(records: list[PromptRecord], backend, scorer, tokenizer, params: SamplingParams) -> dict:
    """Held-out reward: `params.n` = 1 sample per prompt (greedy at eval_temperature 0), scored."""
    prompt_ids = [tokenizer(r.prompt)["input_ids"] for r in records]
    gen = backend.generate(prompt_ids, params)
    samples = [RewardSample(r.prompt, tokenizer.decode(c[0].token_ids, skip_special_tokens=True), r.label,
                            r.metadata) for r, c in zip(records, gen.completions)]
    scored = scorer.score(samples)
    out = {"eval/reward_mean": sum(s.reward for s in scored) / len(scored)}
    for k in scored[0].components if scored else []:
        out[f"eval/{k}"] = sum(s.components[k] for s in scored) / len(scored)
    return out
