"""The one registry of prompt sources: what data.train, data.eval (and `rlhf eval --data`,
`make-prefs`) may name, one module each.

    synthetic:TASK                               synthetic.py      a task built offline
    reasoning-gym:TASK[?OPTIONS]                 reasoning_gym.py  a reasoning-gym task's items
    verifiers                                    environment.py    rollout.environment's own prompts
    hf:NAME[:CONFIG][@SPLIT], FILE.parquet ...   hf.py             a Hugging Face `datasets` source
    FILE.jsonl (anything else)                   jsonl.py          a JSON lines file

Each registers a `SourceKind` (kind.py): its syntax, the offline check of a source, and its rows
or its own prompts. A row is read as a record by records.py. training/data.py asks the registry,
and nothing else names a source kind by its prefix."""

from __future__ import annotations

from . import environment, hf, jsonl, reasoning_gym, synthetic
from .kind import SourceKind

KINDS: tuple[SourceKind, ...] = (synthetic.KIND, reasoning_gym.KIND, environment.KIND, hf.KIND, jsonl.KIND)


def kind_of(source: str) -> SourceKind:
    """The kind of `source`: the first that matches (a JSON lines file when none else does)."""
    return next(k for k in KINDS if k.matches(source))


def problem(source: str) -> str | None:
    """Why `source` cannot be loaded, as far as that shows offline; None otherwise."""
    return kind_of(source).problem(source)
