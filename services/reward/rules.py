"""Rule rewards (verifiers): pure functions of (prompt, response, label, metadata) -> float.

Register your own with `@register_rule("name")`, or point the config at your function by file
path or module (`name: "reward.py:score"`, `"my_pkg.rewards:score"`): services/reward/functions.py
says how, and which signatures it takes (this one, TRL's batched one, verl's compute_score).
"""

from __future__ import annotations

import math
import re
from typing import Callable

from rapidfuzz.distance import Levenshtein

from ..common import reasoning_gym_tasks as gym
from ..common.userfn import is_reference, load_function

# (prompt, response, label, metadata, **the rule's kwargs) -> reward
RuleFn = Callable[..., float]


RULES: dict[str, RuleFn] = {}


def register_rule(name: str) -> Callable[[RuleFn], RuleFn]:
    def deco(fn: RuleFn) -> RuleFn:
        RULES[name] = fn
        return fn

    return deco


def resolve_rule(name: str) -> RuleFn:
    """A registered rule by name, or your function by `path/to/file.py:fn` or `module.path:fn`
    (services/reward/functions.py)."""
    if name in RULES:
        return RULES[name]
    if is_reference(name):
        return load_function(name)
    raise ValueError(
        f"unknown reward rule {name!r}; registered: {', '.join(sorted(RULES))} "
        f"(or give 'path/to/file.py:function' or 'module.path:function')"
    )


def _need_label(label: str | None, rule: str) -> str:
    if label is None:
        raise ValueError(f"rule {rule!r} needs a label (reference answer) for every sample")
    return label


def _normalise(s: str, strip: bool, lowercase: bool) -> str:
    s = s.strip() if strip else s
    return s.lower() if lowercase else s


@register_rule("exact_match")
def exact_match(prompt, response, label, metadata, strip: bool = True, lowercase: bool = False) -> float:
    """1.0 when the response equals the label (after optional strip/lowercase), else 0.0."""
    label = _need_label(label, "exact_match")
    return float(_normalise(response, strip, lowercase) == _normalise(label, strip, lowercase))


@register_rule("verifiable_answer")
def verifiable_answer(
    prompt, response, label, metadata, pattern: str = r"answer\s*[:=]\s*(\S+)", numeric_tol: float = 1e-6
) -> float:
    """Extract the final answer (the last match of `pattern`, or the last \\boxed{...}) and compare
    with the label, numerically when both parse as numbers. 1.0 correct, 0.0 otherwise."""
    label = _need_label(label, "verifiable_answer")
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", response)
    found = boxed or re.findall(pattern, response, flags=re.IGNORECASE)
    if not found:
        return 0.0
    answer = found[-1].strip().rstrip(".")
    try:
        return float(abs(float(answer) - float(label)) <= numeric_tol)
    except ValueError:
        return float(answer == label.strip())


@register_rule("edit_distance")
def edit_similarity(prompt, response, label, metadata, strip: bool = True) -> float:
    """1 - Levenshtein(response, label) / max(len): 1.0 identical, 0.0 nothing in common."""
    label = _need_label(label, "edit_distance")
    a, b = (response.strip(), label.strip()) if strip else (response, label)
    longest = max(len(a), len(b))
    return 1.0 if longest == 0 else 1.0 - Levenshtein.distance(a, b) / longest


@register_rule("repetition")
def repetition_penalty(prompt, response, label, metadata, n: int = 3) -> float:
    """Minus the share of repeated n-grams in the response: 0.0 none repeated, towards -1 all."""
    tokens = response.split() if " " in response.strip() else list(response)
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    return -(1.0 - len(set(grams)) / len(grams))


@register_rule("length")
def length_penalty(
    prompt, response, label, metadata, target: int | None = None, max_len: int | None = None, unit: str = "chars"
) -> float:
    """0.0 inside the limits; minus the relative overshoot past `max_len` or the relative
    distance from `target` (length in `chars` or `words`)."""
    n = len(response.split()) if unit == "words" else len(response)
    if target is not None:
        return -abs(n - target) / max(target, 1)
    if max_len is not None and n > max_len:
        return -(n - max_len) / max(max_len, 1)
    return 0.0


@register_rule("regex_format")
def regex_format(prompt, response, label, metadata, pattern: str = ".*", fullmatch: bool = True) -> float:
    """1.0 when the response matches `pattern` (whole response when `fullmatch`), else 0.0."""
    fn = re.fullmatch if fullmatch else re.search
    return float(fn(pattern, response, flags=re.DOTALL) is not None)


# GSM8K's final-answer marker (lm-eval's strict-match) and lm-eval's flexible-extract number pattern
STRICT_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")
ANY_NUMBER = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
ANSWER_MODES = ("strict", "flexible", "boxed", "auto")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` in `text`, nested braces included; None when there is
    none or it is not closed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start + len("\\boxed"), len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + len("\\boxed{") : i]
    return None


def normalise_answer(answer: str) -> str:
    """An answer as compared: without `$` (or `\\$`), commas, surrounding whitespace and trailing
    periods ("$1,234." -> "1234")."""
    return answer.replace("\\$", "").replace("$", "").replace(",", "").strip().rstrip(".").strip()


def extract_answer(text: str, mode: str = "flexible") -> str | None:
    """The final answer of a response, normalised (normalise_answer); None when there is none.
    strict: the number after the last `#### `; flexible: the last number (lm-eval's flexible-extract,
    skipping matches without a digit such as "..."); boxed: the content of the last `\\boxed{...}`;
    auto: boxed when there is one, else strict when there is a `#### ` number, else flexible."""
    if mode not in ANSWER_MODES:
        raise ValueError(f"unknown answer mode {mode!r}; valid: {', '.join(ANSWER_MODES)}")
    boxed, strict = last_boxed(text), STRICT_ANSWER.findall(text)
    if mode == "auto":
        mode = "boxed" if boxed is not None else "strict" if strict else "flexible"
    if mode == "boxed":
        found = boxed
    elif mode == "strict":
        found = strict[-1] if strict else None
    else:
        numbers = [m.group() for m in ANY_NUMBER.finditer(text) if any(c.isdigit() for c in m.group())]
        found = numbers[-1] if numbers else None
    return (normalise_answer(found) or None) if found is not None else None


def _as_number(s: str) -> float | None:
    try:
        x = float(s)
    except ValueError:
        return None
    return x if math.isfinite(x) else None


def answers_match(a: str, b: str) -> bool:
    """Two normalised answers are equal: numerically when both parse as numbers ("-5" == "-5.0",
    "3.50" == "3.5"), else as strings."""
    x, y = _as_number(a), _as_number(b)
    return x == y if x is not None and y is not None else a == b


@register_rule("math_answer")
def math_answer(prompt, response, label, metadata, mode: str = "flexible", format_score: float = 0.0) -> float:
    """GSM8K-style answer check: the response's answer (extract_answer in `mode`: strict, flexible,
    boxed or auto) against the label, both normalised ("1,234" == "1234"). 1.0 correct,
    `format_score` when an answer was found but is wrong, 0.0 when none was found."""
    label = _need_label(label, "math_answer")
    answer = extract_answer(response, mode)
    if answer is None:
        return 0.0
    return 1.0 if answers_match(answer, normalise_answer(label)) else float(format_score)


@register_rule("reasoning_gym")
def reasoning_gym_answer(prompt, response, label, metadata, require_tag: bool = False, tag: str = "answer") -> float:
    """A reasoning-gym task's own scorer (`score_answer`) of the response's answer, for prompts of a
    `reasoning-gym:` source (their metadata says which task, config and item). The answer is the
    content of the last `<answer>...</answer>` (`tag`), what follows an `<answer>` never closed,
    else the whole response stripped (with `require_tag`, no answer: 0.0). A sample of another
    source is scored as reasoning-gym scores a task without a scorer of its own: 1.0 for the label
    exactly, the label's share of the answer's length when the answer holds it, else 0.0."""
    if not isinstance(tag, str) or not tag.isidentifier():
        raise ValueError(f"tag must be a tag name such as 'answer', not {tag!r}")
    if not isinstance(require_tag, bool):
        raise ValueError(f"require_tag must be true or false, not {require_tag!r}")
    answer = gym.extract_answer(response, tag, require_tag)
    carried = metadata.get(gym.METADATA_KEY) if isinstance(metadata, dict) else None
    if isinstance(carried, dict) and "task" in carried:
        return gym.score(answer, label, carried)
    return gym.default_score(answer, _need_label(label, "reasoning_gym"))
