"""DAPO's two batch-level fixes (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning
System at Scale", arXiv:2503.14476), for a rollout worker, the learner and `train --local` alike.

    overlong_penalty    soft overlong punishment (`reward.overlong_buffer`): a response in the
                        last `buffer` tokens of the length budget loses up to `penalty`, linearly,
                        so that the policy learns to finish before the cut rather than be cut
    informative         a group whose rewards differ: one whose rewards are all equal (all right or
                        all wrong) has no group-relative advantage and teaches GRPO nothing
    merged              the sampling metrics of several rounds as one batch's
    GroupFilter         dynamic sampling (`rollout.dynamic_sampling`): such groups dropped from a
                        batch and more prompts sampled until it is full, at most
                        `rollout.dynamic_sampling_max_rounds` rounds of sampling a batch; past the
                        bound the batch is filled with the dropped groups, with a warning saying so
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..common.types import SampleGroup, ScoreResult

log = logging.getLogger(__name__)

EQUAL = 1e-6  # rewards closer than this are equal (a learned reward is never exactly so)


def overlong_penalty(length: int, max_new_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment of a response of `length` tokens under a budget of
    `max_new_tokens`: 0 up to `max_new_tokens - buffer`, then falling linearly to `-penalty` at the
    budget (a response cut there has `-penalty`). `buffer` 0: no shaping."""
    if buffer <= 0:
        return 0.0
    start = max_new_tokens - buffer
    if length <= start:
        return 0.0
    return -penalty * min(length - start, buffer) / buffer


def shaped(scores: list[ScoreResult], lengths: list[int], max_new_tokens: int, buffer: int, penalty: float):
    """`scores` with each response's overlong penalty added to its reward (and as the component
    `overlong_penalty`); the same scores when `buffer` is 0."""
    if buffer <= 0:
        return scores
    out = []
    for s, n in zip(scores, lengths):
        p = overlong_penalty(n, max_new_tokens, buffer, penalty)
        out.append(ScoreResult(s.reward + p, {**s.components, "overlong_penalty": p}))
    return out


def informative(group: SampleGroup) -> bool:
    """Whether a group's rewards differ (by more than `EQUAL`)."""
    rewards = [s.reward for s in group.scores]
    return max(rewards) - min(rewards) > EQUAL


@dataclass
class GroupFilter:
    """Dynamic sampling over one batch of `want` groups: `add` the groups of each round of sampling
    (a group whose rewards are all equal is held back), `more` says how many prompts the next round
    samples (0: the batch is full, or `max_rounds` rounds are spent), `batch` the batch (held-back
    groups fill it past the bound), `metrics` what it cost."""

    want: int
    max_rounds: int
    kept: list
    held_back: list
    rounds: int = 0

    @classmethod
    def of(cls, want: int, max_rounds: int) -> GroupFilter:
        return cls(want, max_rounds, [], [])

    def add(self, groups: list) -> None:
        self.rounds += 1
        for g in groups:
            (self.kept if informative(g) else self.held_back).append(g)

    def more(self) -> int:
        if len(self.kept) >= self.want or self.rounds >= self.max_rounds:
            return 0
        return self.want - len(self.kept)

    def batch(self, where: str) -> list:
        """The batch: the informative groups, first `want`; past the bound, held-back groups after
        them up to `want` (with a warning naming `where`)."""
        short = self.want - len(self.kept)
        if short > 0 and self.held_back:
            filled = min(short, len(self.held_back))
            log.warning(
                "dynamic sampling: %s has %d of %d groups with rewards that differ after %d rounds "
                "(rollout.dynamic_sampling_max_rounds); %d %s whose rewards are all equal %s it "
                "(they carry no group-relative advantage: the prompts may be too easy or too hard "
                "for the policy)",
                where,
                len(self.kept),
                self.want,
                self.rounds,
                filled,
                "group" if filled == 1 else "groups",
                "fills" if filled == 1 else "fill",
            )
        return self.kept[: self.want] + self.held_back[: max(short, 0)]

    def metrics(self) -> dict:
        """rollout/equal_groups_frac: the share of the groups sampled whose rewards were all equal
        (dropped, or filling the batch past the bound); rollout/dynamic_rounds: rounds of sampling;
        rollout/equal_groups_trained: such groups in the batch (past the bound)."""
        seen = len(self.kept) + len(self.held_back)
        return {
            "rollout/equal_groups_frac": len(self.held_back) / seen if seen else 0.0,
            "rollout/dynamic_rounds": self.rounds,
            "rollout/equal_groups_trained": min(max(self.want - len(self.kept), 0), len(self.held_back)),
        }


SUMMED = ("rollout/tokens", "rollout/prompts_left_out", "rollout/partial_resumed", "rollout/partial_rounds")


def merged(rounds: list[tuple[dict, int]]) -> dict:
    """The sampling metrics of several rounds (each: its metrics, its prompts) as one batch's:
    seconds and counts summed, the rest (reward means, rates) the mean over the rounds weighted by
    their prompts."""
    out: dict = {}
    for key in dict.fromkeys(k for m, _ in rounds for k in m):
        values = [(m[key], n) for m, n in rounds if key in m]
        if key.startswith("time/") or key in SUMMED:
            out[key] = sum(v for v, _ in values)
        else:
            out[key] = sum(v * n for v, n in values) / max(sum(n for _, n in values), 1)
    if "rollout/tokens_per_s" in out:  # the rate of the whole batch, not the mean of the rounds'
        out["rollout/tokens_per_s"] = out["rollout/tokens"] / max(out["time/generate_s"], 1e-9)
    return out
