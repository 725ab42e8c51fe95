"""Partial rollouts (`rollout.partial_tokens`): a batch's responses decoded in chunks of at most
`partial_tokens` new tokens per Generate call, so that a weight push waits for one chunk, not for
the longest response of the batch; each response keeps the policy version of every token.

    PartialRollouts.generate(prompts, params)
      round 0         every prompt, its `params.n` samples, at most `partial_tokens` new tokens
      paused          a sample that stopped on "length" short of `params.max_new_tokens`
      round r >= 1    each paused sample resumed as one prompt of its own: the original prompt +
                      its tokens so far (n=1, `first_prompt_tokens` = the original prompt's
                      length, so a server counts the tokens after it against response_length),
                      all of a round's continuations in one call, at most min(`partial_tokens`,
                      the tokens any of them has left) new tokens
      joined          per sample: its parts' tokens and log-probs one after the other, the last
                      part's finish reason, per token the version that sampled it (a part's own
                      `token_versions`, else its result's `policy_version`); the result's
                      `policy_version` the oldest of its parts, and a completion's
                      `token_versions` None when every token has that version

What a part is decoded by is `call(prompts, params, first_prompt_tokens, part)`: a rollout worker's
Generate on one server (`part` gives each round an idempotency key of its own; round 0 sends no
`first_prompt_tokens`), or an in-process backend (`PartialRollouts.part_of`). A seed, when given, is
`seed + r` in round r: a continuation does not replay the draws of the round before it. Under
greedy decoding the joined response is the one an unpaused call decodes, up to the float rounding
of a prefill of prompt + tokens in place of the incremental steps (tests/rollout/test_partial.py).
What it costs: each continuation prefills its prompt and tokens so far again (docs/async.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

from ..common.types import Completion, GenerationResult, SamplingParams

# one part of a batch: (prompts, params, first_prompt_tokens or None, round) -> its result
PartCall = Callable[[list[list[int]], SamplingParams, Optional[list[int]], int], GenerationResult]


@dataclass
class _Response:
    """One sample decoded in parts: its prompt, its tokens so far with their log-probs and versions."""

    prompt: list[int]
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = "length"

    def add(self, part: Completion, version: int) -> None:
        self.token_ids += part.token_ids
        self.log_probs += part.log_probs
        self.versions += part.versions(version)
        self.finish_reason = part.finish_reason

    def paused(self, max_new_tokens: int) -> bool:
        return self.finish_reason == "length" and len(self.token_ids) < max_new_tokens

    def completion(self, oldest: int) -> Completion:
        one = all(v == oldest for v in self.versions)
        return Completion(self.token_ids, self.log_probs, self.finish_reason, None, None if one else self.versions)


class PartialRollouts:
    """`generate(prompts, params)` as a backend offers it, decoded `partial_tokens` new tokens per
    call of `call` (see the module's docstring); `metrics` of the last batch:
    rollout/partial_resumed (continuations sent) and rollout/partial_rounds (calls made)."""

    def __init__(self, call: PartCall, partial_tokens: int):
        if partial_tokens < 1:
            raise ValueError(f"partial_tokens: {partial_tokens}, at least 1 (0 means: do not wrap)")
        self.call, self.partial_tokens = call, partial_tokens
        self.metrics: dict[str, float] = {}

    @staticmethod
    def part_of(backend) -> PartCall:
        """The part call of a backend in this process (its `generate(prompts, params)`; no server,
        no key)."""
        return lambda prompts, params, _first, _part: backend.generate(prompts, params)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> GenerationResult:
        t0 = time.perf_counter()
        chunk = replace(params, max_new_tokens=min(self.partial_tokens, params.max_new_tokens))
        first = self.call([list(p) for p in prompts], chunk, None, 0)
        responses = [[_Response(list(p)) for _ in comps] for p, comps in zip(prompts, first.completions)]
        for rs, comps in zip(responses, first.completions):
            for r, c in zip(rs, comps):
                r.add(c, first.policy_version)
        oldest, rounds, resumed = first.policy_version, 1, 0
        while paused := [r for rs in responses for r in rs if r.paused(params.max_new_tokens)]:
            oldest = min(oldest, self._resume(paused, params, rounds))
            rounds, resumed = rounds + 1, resumed + len(paused)
        self.metrics = {"rollout/partial_resumed": resumed, "rollout/partial_rounds": rounds}
        completions = [[r.completion(oldest) for r in rs] for rs in responses]
        tokens = sum(len(c.token_ids) for cs in completions for c in cs)
        return GenerationResult(completions, oldest, tokens, time.perf_counter() - t0)

    def _resume(self, paused: list[_Response], params: SamplingParams, part: int) -> int:
        """Round `part`: every paused response one prompt of a call, its next chunk added to it.
        Returns the version the call began on."""
        left = min(params.max_new_tokens - len(r.token_ids) for r in paused)
        chunk = replace(
            params,
            n=1,
            max_new_tokens=min(self.partial_tokens, left),
            seed=None if params.seed is None else params.seed + part,
        )
        result = self.call([r.prompt + r.token_ids for r in paused], chunk, [len(r.prompt) for r in paused], part)
        if len(result.completions) != len(paused) or any(len(cs) != 1 for cs in result.completions):
            raise RuntimeError(
                f"partial rollouts: round {part} sent {len(paused)} continuations (n=1) and got back "
                f"{[len(cs) for cs in result.completions]} completions per prompt"
            )
        for r, (c,) in zip(paused, result.completions):
            if not c.token_ids:
                raise RuntimeError(f"partial rollouts: round {part} resumed a response and got no token back")
            r.add(c, result.policy_version)
        return result.policy_version
