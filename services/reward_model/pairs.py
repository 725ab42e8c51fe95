"""Preference pairs from judged samples: every pair the judge tells apart, and hard negatives.

A prompt's samples, each scored by the judge, give every pair of two different texts whose scores
differ by at least `min_gap`, the better as chosen: k right answers of n give k * (n - k) pairs,
not one. A text sampled twice counts once, and two samples the judge scores alike are no pair.

A pair is *hard* when its two answers share their form and differ only in their numbers: the same
text once each number is replaced by `#` ("14 + 15 = 29" against "14 + 15 = 39"). Those are what
teach a reward model the sum rather than the shape of an answer, and a policy's samples hold few
of them, so `counterfactuals` makes more: copies of an answer with one of its numbers changed
(and, given the prompt's numeric label, a copy with the label as its last number: a wrong
answer corrected in its own form), which the judge scores like any sample (a copy it scores as
well as the original is no pair).
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

# a number: not inside a word or another number ("x2", the "-5" of "10-5" is 5), "1,234" as one
NUMBER = re.compile(r"(?<![\w.,])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
NUDGES = (1, 2, 3, 5, 9, 10, 11, 20, 100)  # how far a counterfactual moves a number (up or down)


@dataclass
class Judged:
    """One answer to a prompt and the judge's score of it."""

    text: str
    score: float
    synthetic: bool = False  # made by `counterfactuals`, not sampled


def form(text: str) -> str:
    """The text with each number replaced by `#`: two answers of one form differ only in numbers."""
    return NUMBER.sub("#", text.strip())


def is_hard(a: str, b: str) -> bool:
    """Whether two answers share their form and differ in a number."""
    return a.strip() != b.strip() and form(a) == form(b) and bool(NUMBER.search(a))


def counterfactuals(text: str, k: int, rng: random.Random, label=None) -> list[str]:
    """Up to `k` different copies of `text`, each with one of its numbers moved by a nudge (the
    last number in half of them: where an answer usually is); none when it has no number. With a
    numeric `label`, the first copy has the label in place of the last number: a wrong answer
    corrected in its own words (a right one is left as it is)."""
    spans = [m.span() for m in NUMBER.finditer(text)]
    out: list[str] = []
    if spans and k > 0 and label is not None and NUMBER.fullmatch(str(label).strip()):
        start, end = spans[-1]
        corrected = text[:start] + str(label).strip() + text[end:]
        if corrected != text:
            out.append(corrected)
    for _ in range(4 * k):  # a few tries: two nudges can make the same copy
        if not spans or len(out) == k:
            break
        start, end = spans[-1] if rng.random() < 0.5 else rng.choice(spans)
        copy = text[:start] + nudged(text[start:end], rng.choice(NUDGES) * rng.choice((-1, 1))) + text[end:]
        if copy != text and copy not in out:
            out.append(copy)
    return out


def nudged(number: str, by: int) -> str:
    """`number` (as NUMBER reads it) moved by `by`, written the way it was: its decimals, its commas."""
    digits = number.replace(",", "")
    decimals = len(digits.split(".")[1]) if "." in digits else 0
    value = round(float(digits) + by, decimals) if decimals else int(digits) + by
    return f"{value:,.{decimals}f}" if "," in number else f"{value:.{decimals}f}"


def judged_pairs(answers: list[Judged], min_gap: float) -> list[tuple[Judged, Judged]]:
    """Every (chosen, rejected) of a prompt's answers whose scores differ by at least `min_gap`,
    each text once; best chosen first, then by text (a fixed order)."""
    unique: dict[str, Judged] = {}
    for a in answers:
        if math.isfinite(a.score):  # a score the judge could not give is no preference
            unique.setdefault(a.text, a)  # a sampled text wins over the same text made synthetically
    ranked = sorted(unique.values(), key=lambda a: (-a.score, a.text))
    return [(c, r) for i, c in enumerate(ranked) for r in ranked[i + 1 :] if c.score - r.score >= min_gap]


def pair_row(rid: str, prompt: str, label, chosen: Judged, rejected: Judged) -> dict:
    """A pair as `rlhf train-rm` reads it, with what the judge said and whether it is hard."""
    return {
        "id": rid,
        "prompt": prompt,
        "chosen": chosen.text,
        "rejected": rejected.text,
        "chosen_reward": chosen.score,
        "rejected_reward": rejected.score,
        "label": label,
        "hard": is_hard(chosen.text, rejected.text),
        "synthetic": chosen.synthetic or rejected.synthetic,
    }


def cap_pairs(pairs: list[tuple[Judged, Judged]], limit: int | None, rng: random.Random) -> list:
    """At most `limit` of a prompt's pairs (None: all), hard ones kept first, the rest drawn."""
    if limit is None or len(pairs) <= limit:
        return pairs
    hard = [p for p in pairs if is_hard(p[0].text, p[1].text)]
    easy = [p for p in pairs if not is_hard(p[0].text, p[1].text)]
    rng.shuffle(hard)
    rng.shuffle(easy)
    return (hard + easy)[:limit]
