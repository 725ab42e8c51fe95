"""Preference pairs, from the formats people have, as the texts a reward model is trained on.

A pair is read from a row with a chosen and a rejected answer, and optionally the prompt:

    TRL, explicit prompt     {"prompt": "...", "chosen": "...", "rejected": "..."}
    TRL, conversational      {"prompt": [{"role": "user", ...}], "chosen": [{"role": "assistant", ...}], ...}
    TRL, implicit prompt     {"chosen": [...whole conversation...], "rejected": [...]}  (or two strings)
    OpenRLHF                 any keys: `prompt_key`, `chosen_key`, `rejected_key` (and `margin_key`)

Each side is scored as the reward server sees a sample during PPO: the prompt as the policy is
given it (chat messages rendered through the tokenizer's chat template once, with the generation
prompt; a string prompt as is, or as one user message when `chat_template`) followed by the
response text (an assistant message's content). In the implicit form the messages the two sides
share from the start are the prompt; two strings are scored whole.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ..training.data import read_rows
from ..training.sources.records import render_prompt


@dataclass
class Preference:
    id: str
    prompt: str  # as the policy sees it (rendered)
    chosen: str  # the response text the judge preferred
    rejected: str
    margin: float = 0.0  # how much more chosen is preferred (added to the loss's margin when set)
    hard: bool = False  # two answers of one form, different numbers (`rlhf make-prefs` marks them)
    gold: tuple[float, float] | None = None  # the judge's scores of (chosen, rejected), when the row has them

    @property
    def texts(self) -> tuple[str, str]:
        """(chosen, rejected) as the reward model scores them: prompt + response."""
        return self.prompt + self.chosen, self.prompt + self.rejected


@dataclass
class PreferenceKeys:
    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"
    margin: str | None = None


def _is_messages(value) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


def _response_text(value, where: str, side: str) -> str:
    """A response: a string, or assistant messages (their contents, joined)."""
    if isinstance(value, str):
        return value
    if _is_messages(value):
        roles = {m["role"] for m in value}
        if roles != {"assistant"}:
            raise ValueError(f"{where}: {side} must be the assistant's answer; it has messages of {sorted(roles)}")
        return "".join(str(m["content"]) for m in value)
    raise ValueError(f"{where}: {side} must be a string or a list of chat messages, not {type(value).__name__}")


def _split_conversations(chosen: list, rejected: list, where: str) -> tuple[list, list, list]:
    """The implicit-prompt form: (the shared leading messages, chosen's rest, rejected's rest)."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if n == 0:
        raise ValueError(
            f"{where}: chosen and rejected share no leading message, so there is no prompt; give a 'prompt' field"
        )
    return chosen[:n], chosen[n:], rejected[n:]


def preference_from_row(
    row: dict, where: str, keys: PreferenceKeys, tokenizer=None, chat_template: bool = False
) -> Preference:
    for k in (keys.chosen, keys.rejected):
        if k not in row:
            raise ValueError(
                f"{where}: no {k!r} field (it has {sorted(row)}); set reward_model.chosen_key / "
                "rejected_key to the fields that hold the two answers"
            )
    chosen, rejected = row[keys.chosen], row[keys.rejected]
    prompt = row.get(keys.prompt)
    if prompt is None:  # implicit prompt
        if _is_messages(chosen) and _is_messages(rejected):
            prompt, chosen, rejected = _split_conversations(chosen, rejected, where)
        elif isinstance(chosen, str) and isinstance(rejected, str):
            prompt = ""
        else:
            raise ValueError(
                f"{where}: without a prompt, chosen and rejected must both be strings or both conversations"
            )
    if isinstance(prompt, str):
        rendered = render_prompt(prompt, tokenizer, chat_template) if prompt else ""
    elif _is_messages(prompt):
        rendered = render_prompt(prompt, tokenizer)
    else:
        raise ValueError(f"{where}: the prompt must be a string or chat messages, not {type(prompt).__name__}")
    margin = float(row[keys.margin]) if keys.margin and row.get(keys.margin) is not None else 0.0
    return Preference(
        id=str(row.get("id", where)),
        prompt=rendered,
        chosen=_response_text(chosen, where, "chosen"),
        rejected=_response_text(rejected, where, "rejected"),
        margin=margin,
        hard=bool(row.get("hard", False)),
        gold=_gold(row, where),
    )


def _gold(row: dict, where: str) -> tuple[float, float] | None:
    """The judge's scores of a `rlhf make-prefs` row (chosen_reward, rejected_reward), if it has them."""
    if row.get("chosen_reward") is None or row.get("rejected_reward") is None:
        return None
    try:
        gold = (float(row["chosen_reward"]), float(row["rejected_reward"]))
    except (TypeError, ValueError):
        raise ValueError(f"{where}: chosen_reward and rejected_reward must be numbers") from None
    if not all(math.isfinite(g) for g in gold):
        raise ValueError(f"{where}: chosen_reward and rejected_reward must be finite")
    return gold


def load_preferences(
    source: str, split: str, keys: PreferenceKeys, tokenizer=None, chat_template: bool = False, limit: int | None = None
) -> list[Preference]:
    """Every pair of `source` (a .jsonl, .parquet, .csv or .json file, or hf:DATASET[@SPLIT])."""
    pairs = [
        preference_from_row(row, where, keys, tokenizer, chat_template)
        for where, row in read_rows(source, split, limit)
    ]
    if not pairs:
        raise ValueError(f"{source}: no preference pairs")
    return pairs


def split_held_out(pairs: list[Preference], fraction: float, seed: int) -> tuple[list[Preference], list[Preference]]:
    """(train, held-out): `fraction` of the pairs, drawn with `seed`, held out; pairs with the same
    prompt stay on one side (a held-out prompt is one the model never trained on)."""
    rng = random.Random(seed)
    prompts = sorted({p.prompt for p in pairs})
    if len(prompts) < 2:  # no prompts to tell apart (two whole texts per row): pairs are held out instead
        order = list(range(len(pairs)))
        rng.shuffle(order)
        held_idx = set(order[: round(fraction * len(pairs))])
        train = [p for i, p in enumerate(pairs) if i not in held_idx]
        held_out = [p for i, p in enumerate(pairs) if i in held_idx]
    else:
        rng.shuffle(prompts)
        held = set(prompts[: max(1, round(fraction * len(prompts)))]) if fraction > 0 else set()
        train = [p for p in pairs if p.prompt not in held]
        held_out = [p for p in pairs if p.prompt in held]
    if not train:
        raise ValueError(f"holding out {fraction:g} of the pairs leaves none to train on")
    return train, held_out
