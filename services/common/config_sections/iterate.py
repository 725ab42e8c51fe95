"""Iterated RLHF's section (`rlhf iterate`): rounds of PPO, fresh pairs from the policy, the reward
model trained on."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Strict


class IterateConfig(Strict):
    rounds: int = Field(
        default=2,
        ge=1,
        description="rounds of (pairs from the current policy -> the reward model trained on them -> PPO "
        "for iterations_per_round iterations); round 0's pairs come from model.path (docs/iterated-rlhf.md)",
    )
    iterations_per_round: int = Field(
        default=10, ge=1, description="PPO iterations each round (one run continued across the rounds)"
    )
    prompts_per_round: int = Field(
        default=192,
        ge=1,
        description="training prompts each round's pairs are made on: round r takes data.train's prompts "
        "[r x this, (r + 1) x this), so no round re-labels another's",
    )
    probe_prompts: int = Field(
        default=64,
        ge=0,
        description="after the last round, pairs from the final policy on this many further training prompts, "
        "to measure the final reward model on the policy's own answers (0: none)",
    )
    samples_per_prompt: int = Field(default=8, ge=2, description="samples of the policy per prompt (make-prefs --n)")
    more: int = Field(
        default=8, ge=0, description="further samples of each prompt the judge told apart (make-prefs --more)"
    )
    hard_negatives: int = Field(
        default=4, ge=0, description="counterfactuals of each best answer, judged (make-prefs --hard-negatives)"
    )
    max_pairs_per_prompt: int = Field(
        default=8, ge=1, description="at most this many pairs of a prompt, hard ones first"
    )
    reward_model: Literal["continue", "fresh"] = Field(
        default="continue",
        description="continue: each round's reward model goes on from the previous round's; fresh: each "
        "round trains one from reward_model.base (or model.path)",
    )
    pairs: Literal["all", "new"] = Field(
        default="all", description="the reward model trains on the pairs of every round so far (all) or of this round"
    )
    critic: Literal["keep", "reset"] = Field(
        default="keep",
        description="keep: the critic goes on from the previous round; reset: it starts again from its "
        "initial weights (the previous round's critic moved to its round directory)",
    )
