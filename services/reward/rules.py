"""Rule rewards (verifiers): pure functions of (prompt, response, label, metadata) -> float.

Register your own with `@register_rule("name")`, or point the config at any function by import
path (`name: "my_pkg.rewards:score"`) with the same signature.
"""
from __future__ import annotations

import importlib
import re
from typing import Callable, Protocol

from rapidfuzz.distance import Levenshtein


class RuleFn(Protocol):
    def __call__(self, prompt: str, response: str, label: str | None, metadata: dict, **kwargs) -> float: ...


RULES: dict[str, RuleFn] = {}


def register_rule(name: str) -> Callable[[RuleFn], RuleFn]:
    def deco(fn: RuleFn) -> RuleFn:
        RULES[name] = fn
        return fn
    return deco


def resolve_rule(name: str) -> RuleFn:
    """A registered rule by name, or a function by `module.path:function`."""
    if name in RULES:
        return RULES[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"reward rule {name!r} cannot be imported: {e}") from None
        if not callable(fn):
            raise ValueError(f"reward rule {name!r} is not callable")
        return fn
    raise ValueError(f"unknown reward rule {name!r}; registered: {', '.join(sorted(RULES))} "
                     f"(or give 'module.path:function')")


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
def verifiable_answer(prompt, response, label, metadata, pattern: str = r"answer\s*[:=]\s*(\S+)",
                      numeric_tol: float = 1e-6) -> float:
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
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    return -(1.0 - len(set(grams)) / len(grams))


@register_rule("length")
def length_penalty(prompt, response, label, metadata, target: int | None = None, max_len: int | None = None,
                   unit: str = "chars") -> float:
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
