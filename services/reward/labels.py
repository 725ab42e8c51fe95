"""Which rewards read a record's label (its reference answer): where one does, prompts without a
label are an error before the run starts (training/data.py: `missing_labels`, told by the commands
that read the data which part of the reward reads labels), not a None handed to it.

    a built-in rule        reads it when it fails without one (exact_match, verifiable_answer,
                           math_answer, edit_distance, reasoning_gym; not length, repetition,
                           regex_format); a reasoning-gym source's records are not checked: an
                           item's label is its task's answer, and a task without one (its
                           scorer needs none) has none
    your function          reads it when its signature names it: `label` (per sample, batched)
                           or `ground_truth` (verl's)
    a reward model, an HTTP reward API, an agent's own reward
                           no: they may do without one
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .functions import RewardFunction
from .rules import RULES

if TYPE_CHECKING:
    from ..common.config import Config


def label_reader(cfg: Config) -> str | None:
    """The first part of the reward that reads labels, by its key ("reward.rules[0] (exact_match)"),
    or None when none does."""
    if cfg.rollout.agent_kind is not None:  # the agent scores its sessions
        return None
    rc = cfg.reward
    keyed = [("reward.rules", rc.rules)] if rc.type in ("rules", "combined") else []
    keyed.append(("reward.eval_rules", rc.eval_rules or []))
    for key, specs in keyed:
        for i, spec in enumerate(specs):
            if reads_label(spec.name, spec.kwargs):
                return f"{key}[{i}] ({spec.name})"
    return None


def reads_label(name: str, kwargs: dict) -> bool:
    """Whether the rule `name` (built in, or your function) reads the label."""
    try:
        fn = RewardFunction.build(name, kwargs, RULES)
    except ValueError:  # the reward's own checks say what is wrong with it
        return False
    if not fn.builtin:
        return bool({"label", "ground_truth"} & fn.params)
    try:
        fn.fn("", "0", None, {}, **kwargs)
    except Exception:
        return True
    return False
