"""Prompt datasets: JSON lines files, or a synthetic task built offline.

A record is `{"prompt": str}` or `{"messages": [{"role", "content"}, ...]}` (rendered through
the tokenizer's chat template), with an optional label (the reference answer a rule reward
checks against). `synthetic:reverse` is the tiny default task: reverse a short string of
letters; train and held-out prompts are disjoint.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

ALPHABET = "abcdefgh"
MIN_LEN, MAX_LEN = 3, 5


@dataclass
class PromptRecord:
    id: str
    prompt: str
    label: str | None = None
    metadata: dict = field(default_factory=dict)


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


SYNTHETIC_TASKS = {"reverse": reverse_task}


def render_prompt(record: dict, tokenizer, prompt_key: str = "prompt") -> str:
    if "messages" in record:
        return tokenizer.apply_chat_template(record["messages"], tokenize=False, add_generation_prompt=True)
    if prompt_key not in record:
        raise ValueError(f"record has neither {prompt_key!r} nor 'messages': {sorted(record)}")
    return str(record[prompt_key])


def load_prompts(source: str, split: str, tokenizer=None, prompt_key: str = "prompt", label_key: str = "label",
                 limit: int | None = None, seed: int = 0) -> list[PromptRecord]:
    """Load prompt records from `synthetic:<task>`, a JSON lines file, or a Hugging Face `datasets`
    source: `hf:<name>[:<config>][@<split>]` (a hub dataset or a local dataset directory) or a
    `.parquet`, `.csv` or `.json` file. The default split is the `split` argument."""
    if source.startswith("synthetic:"):
        task = source.split(":", 1)[1]
        if task not in SYNTHETIC_TASKS:
            raise ValueError(f"unknown synthetic task {task!r}; valid: {', '.join(SYNTHETIC_TASKS)}")
        return SYNTHETIC_TASKS[task](split, limit, seed)
    if source.startswith("hf:") or source.endswith(DATASETS_FILE_TYPES):
        return _from_datasets(source, split, tokenizer, prompt_key, label_key, limit)
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    out = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e}") from None
            out.append(_record(record, f"{path.name}:{lineno}", tokenizer, prompt_key, label_key))
            if limit is not None and len(out) >= limit:
                break
    return out


DATASETS_FILE_TYPES = (".parquet", ".csv", ".json")


def _record(record: dict, default_id: str, tokenizer, prompt_key: str, label_key: str) -> PromptRecord:
    label = record.get(label_key, record.get("solution"))
    return PromptRecord(id=str(record.get("id", default_id)), prompt=render_prompt(record, tokenizer, prompt_key),
                        label=None if label is None else str(label),
                        metadata={k: v for k, v in record.items()
                                  if k not in (prompt_key, "messages", label_key, "solution", "id")})


def _from_datasets(source: str, split: str, tokenizer, prompt_key: str, label_key: str,
                   limit: int | None) -> list[PromptRecord]:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"data source {source!r} needs the `datasets` package: pip install datasets") from None
    spec = source[3:] if source.startswith("hf:") else source
    spec, _, want_split = spec.partition("@")
    want_split = want_split or split
    if source.startswith("hf:"):
        name, _, config = spec.partition(":")
        ds = datasets.load_dataset(name, config or None, split=want_split)
    else:
        kind = Path(spec).suffix.lstrip(".")
        if not Path(spec).exists():
            raise FileNotFoundError(f"prompt file {spec} does not exist")
        ds = datasets.load_dataset(kind, data_files={want_split: spec}, split=want_split)
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    label = Path(spec).name
    return [_record(dict(row), f"{label}:{i}", tokenizer, prompt_key, label_key) for i, row in enumerate(ds)]


class EpochSampler:
    """Yields records in a fresh shuffled order each epoch; `epoch` counts completed passes."""

    def __init__(self, records: list[PromptRecord], seed: int = 0):
        if not records:
            raise ValueError("the prompt dataset is empty")
        self.records, self.rng, self.epoch = records, random.Random(seed), 0
        self._order: list[int] = []
        self._started = False

    def __iter__(self) -> Iterator[PromptRecord]:
        return self

    def __next__(self) -> PromptRecord:
        if not self._order:
            if self._started:
                self.epoch += 1
            self._started = True
            self._order = list(range(len(self.records)))
            self.rng.shuffle(self._order)
        return self.records[self._order.pop()]

    def take(self, n: int) -> list[PromptRecord]:
        return [next(self) for _ in range(n)]

    def take_with_epochs(self, n: int) -> list[tuple[int, PromptRecord]]:
        """Like `take`, with the epoch each record was drawn in."""
        out = []
        for _ in range(n):
            rec = next(self)
            out.append((self.epoch, rec))
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "order": list(self._order), "started": self._started,
                "rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self._order, self._started = int(state["epoch"]), list(state["order"]), bool(state["started"])
        self.rng.setstate(state["rng"])
