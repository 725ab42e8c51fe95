"""A JSON lines file: one JSON object a line (blank lines skipped), each a row read as a record
(records.py). The kind of any source that is of no other kind."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from .kind import SourceKind, missing


def problem(source: str) -> str | None:
    return missing(source)


def rows(source: str, split: str, limit: int | None = None) -> list[tuple[str, dict]]:
    """The file's rows (the same for every split), each with where it is (`file.jsonl:LINE`)."""
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"data file {path} does not exist")
    out = []
    for lineno, line in _lines(path):
        out.append((f"{path.name}:{lineno}", _parsed(path, lineno, line)))
        if limit is not None and len(out) >= limit:
            break
    return out


def jsonl_rows(source: str) -> tuple[list[tuple[str, dict]], list[str]]:
    """Every record of the JSON lines file `source`, each with where it is (`file.jsonl:LINE`), and
    the problem of every line that is no JSON object ("FILE:LINE: not JSON: ...")."""
    path, rows, problems = Path(source), [], []
    for lineno, line in _lines(path):
        try:
            rows.append((f"{path.name}:{lineno}", _parsed(path, lineno, line)))
        except ValueError as e:
            problems.append(str(e))
    return rows, problems


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """The numbered lines of a JSON lines file that are not blank."""
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                yield lineno, line


def _parsed(path: Path, lineno: int, line: str) -> dict:
    """One line of a JSON lines file as its record; a ValueError naming the file and line if it is none."""
    try:
        record = json.loads(line.rstrip())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}:{lineno}: a record must be a JSON object, not {type(record).__name__}")
    return record


KIND = SourceKind("jsonl", "FILE.jsonl", lambda s: True, problem, rows=rows)
