"""What a prompt source kind is (the registry, __init__.py, lists them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional


@dataclass(frozen=True)
class SourceKind:
    """One kind of prompt source: its `name`, the `syntax` errors show, whether a source string is
    of it (`matches`), why one cannot be loaded as far as that shows offline (`problem`, None: it
    can). Then one of two ways to its prompts:

    - `rows(source, split, limit) -> [(where, row)]`: a source of rows, read as records the way
      data.prompt_key / data.label_key say (records.py), its held-out prompts a split of
      data.train's when data.eval is unset;
    - `prompts(source, split, options) -> [PromptRecord]`: a source that makes its own records and
      its own held-out set (`split` "eval"), and, with `run_prompts(cfg, source, split, tokenizer)`,
      one that chooses them for a run from the config (a held-out set that no training prompt is
      in, an environment's own dataset)."""

    name: str
    syntax: str
    matches: Callable[[str], bool]
    problem: Callable[[str], Optional[str]]
    rows: Optional[Callable] = None
    prompts: Optional[Callable] = None
    run_prompts: Optional[Callable] = None

    @property
    def own_held_out(self) -> bool:
        """Whether it gives its own held-out prompts (else they are a split of data.train's)."""
        return self.rows is None


def missing(path: str, what: str = "file") -> str | None:
    """'no such file PATH' when nothing is there, saying where a relative path was looked for (the
    current directory, not the config file's: `base:` alone is read from the file's folder)."""
    p = Path(path)
    if p.exists():
        return None
    where = "" if p.is_absolute() else f" (relative paths are read from the current directory, {Path.cwd()})"
    return f"no such {what} {path}{where}"
