"""Synthetic tasks built offline, `synthetic:TASK`: `reverse` (the tiny default: "abc=" -> "cba"),
`arithmetic` (the sum of two 2-digit numbers), `multiply` (their product). Train and held-out
prompts of a task are disjoint, by a split that no seed changes."""

from __future__ import annotations

import dataclasses
import random
import zlib

from ...common.types import PromptRecord
from .kind import SourceKind
from .records import PromptOptions

PREFIX = "synthetic:"

ALPHABET = "abcdefgh"
MIN_LEN, MAX_LEN = 3, 5


def _is_held_out(s: str) -> bool:
    # a fixed, seed-independent split: about one string in five is held out
    return sum((i + 7) * ord(c) for i, c in enumerate(s)) % 5 == 0


def reverse_task(split: str, n: int | None = None, seed: int = 0) -> list[PromptRecord]:
    """The synthetic `reverse` task: prompt "abc=" -> answer "cba". `split` is train or eval."""
    rng = random.Random(f"reverse-{split}-{seed}")
    want_held_out = split == "eval"
    out: list[PromptRecord] = []
    seen: set[str] = set()
    limit = n if n is not None else 4096
    tries = 0
    while len(out) < limit and tries < limit * 50:
        tries += 1
        length = rng.randint(MIN_LEN, MAX_LEN)
        s = "".join(rng.choice(ALPHABET) for _ in range(length))
        if s in seen or _is_held_out(s) != want_held_out:
            continue
        seen.add(s)
        out.append(PromptRecord(id=f"reverse-{split}-{s}", prompt=f"{s}=", label=s[::-1]))
    return out


def _pair_held_out(a: int, b: int) -> bool:
    # a fixed, seed-independent split of unordered pairs (a + b and b + a fall on the same side):
    # about one pair in five is held out
    return zlib.crc32(f"{min(a, b)}+{max(a, b)}".encode()) % 5 == 0


def _pairs(split: str, n: int | None, seed: int, task: str) -> list[tuple[int, int]]:
    """The (a, b) pairs of a two-number task, a and b in 10..99: the split's, in an order shuffled
    by `seed` for train; the eval order ignores it, so every run holds out the same prompts."""
    held_out = split == "eval"
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100) if _pair_held_out(a, b) == held_out]
    random.Random(f"{task}-eval" if held_out else f"{task}-train-{seed}").shuffle(pairs)
    return pairs[:n]


def arithmetic_task(split: str, n: int | None = None, seed: int = 0) -> list[PromptRecord]:
    """The synthetic `arithmetic` task: prompt "What is 52 + 97? Answer with the number only."
    -> answer "149", for a and b in 10..99. `split` is train or eval; n = None takes every pair of
    the split."""
    return [
        PromptRecord(
            id=f"arithmetic-{split}-{a}+{b}",
            prompt=f"What is {a} + {b}? Answer with the number only.",
            label=str(a + b),
        )
        for a, b in _pairs(split, n, seed, "arithmetic")
    ]


def multiply_task(split: str, n: int | None = None, seed: int = 0) -> list[PromptRecord]:
    """The synthetic `multiply` task: "What is 52 times 97? Answer with the number only." ->
    "5044" (a and b in 10..99, in `metadata` too): beyond a small model's mental arithmetic, for
    an environment that offers a calculator (examples/calculator_env.py)."""
    return [
        PromptRecord(
            id=f"multiply-{split}-{a}x{b}",
            prompt=f"What is {a} times {b}? Answer with the number only.",
            label=str(a * b),
            metadata={"a": a, "b": b},
        )
        for a, b in _pairs(split, n, seed, "multiply")
    ]


TASKS = {"reverse": reverse_task, "arithmetic": arithmetic_task, "multiply": multiply_task}


def problem(source: str) -> str | None:
    task = source.removeprefix(PREFIX)
    return None if task in TASKS else f"unknown synthetic task {task!r}; valid: {', '.join(TASKS)}"


def prompts(source: str, split: str, options: PromptOptions) -> list[PromptRecord]:
    """The task's records of `split` (at most `options.limit`, drawn with `options.seed`), their
    prompts rendered when the options ask for a chat template or an instruction."""
    why = problem(source)
    if why:
        raise ValueError(why)
    records = TASKS[source.removeprefix(PREFIX)](split, options.limit, options.seed)
    if not options.chat_template and not options.instruction:
        return records
    return [dataclasses.replace(r, prompt=options.render(r.prompt)) for r in records]


KIND = SourceKind("synthetic", "synthetic:TASK", lambda s: s.startswith(PREFIX), problem, prompts=prompts)
