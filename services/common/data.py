"""Prompt datasets: JSON lines files, Hugging Face `datasets` sources, or a synthetic task built
offline.

A record is `{"prompt": str}` or `{"messages": [{"role", "content"}, ...]}` (rendered through
the tokenizer's chat template), with an optional label (the reference answer a rule reward
checks against). `synthetic:reverse` is the tiny default task: reverse a short string of
letters; train and held-out prompts are disjoint.
"""
from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Iterator

from .types import PromptRecord

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


SYNTHETIC_TASKS = {"reverse": reverse_task}
DATASETS_FILE_TYPES = (".parquet", ".csv", ".json")
# the dataset splits `hf:` sources fall back to, in order, when the wanted split is missing
SPLIT_CHOICES = {"train": ("train",), "eval": ("eval", "test", "validation", "valid")}


def source_problem(source: str) -> str | None:
    """Why `source` cannot be loaded, as far as that shows offline: an unknown synthetic task, or a
    local file or `hf:` dataset directory that does not exist (relative paths are taken from the
    current directory). None otherwise; hub dataset names are not checked."""
    if source.startswith("synthetic:"):
        task = source.split(":", 1)[1]
        known = task in SYNTHETIC_TASKS
        return None if known else f"unknown synthetic task {task!r}; valid: {', '.join(SYNTHETIC_TASKS)}"
    if source.startswith("hf:"):
        local = _local_dataset_dir(_parse_hf(source)[0])
        return f"no such dataset directory {local}" if local is not None and not local.exists() else None
    return None if Path(source).exists() else f"no such file {source}"


def _parse_hf(source: str) -> tuple[str, str | None, str | None]:
    """`hf:<name>[:<config>][@<split>]` -> (name, config, split)."""
    spec, _, split = source[3:].partition("@")
    name, _, config = spec.partition(":")
    return name, config or None, split or None


def _local_dataset_dir(name: str) -> Path | None:
    """`name` as a local directory when it looks like one: it starts with '/', './', '../' or '~', or
    is an existing directory. None for anything else (a hub dataset name)."""
    path = Path(name).expanduser()
    return path if name.startswith(("/", "./", "../", "~")) or path.is_dir() else None


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
    `.parquet`, `.csv` or `.json` file. The default split is the `split` argument; an `hf:` source
    without one takes the first of SPLIT_CHOICES[split] it has (eval: eval, test, validation, valid)."""
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
    if source.startswith("hf:"):
        name, config, want_split = _parse_hf(source)
        local = _local_dataset_dir(name)
        name = name if local is None else str(local)
        candidates = (want_split,) if want_split else SPLIT_CHOICES.get(split, (split,))
        if local is not None and (local / "dataset_dict.json").exists():  # written by DatasetDict.save_to_disk
            splits = datasets.load_from_disk(name)
            ds = splits[_pick_split(source, candidates, list(splits))]
        else:
            if want_split is None:
                want_split = _pick_split(source, candidates, datasets.get_dataset_split_names(name, config))
            ds = datasets.load_dataset(name, config, split=want_split)
    else:
        name, want_split = source, split
        if not Path(name).exists():
            raise FileNotFoundError(f"prompt file {name} does not exist")
        ds = datasets.load_dataset(Path(name).suffix.lstrip("."), data_files={want_split: name}, split=want_split)
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    label = Path(name).name
    return [_record(dict(row), f"{label}:{i}", tokenizer, prompt_key, label_key) for i, row in enumerate(ds)]


def _pick_split(source: str, candidates: tuple[str, ...], available: list[str]) -> str:
    """The first of `candidates` that the dataset has."""
    for name in candidates:
        if name in available:
            return name
    base = source.partition("@")[0]
    raise ValueError(f"{source} has no {'/'.join(candidates)} split (it has {', '.join(available)}); "
                     f"choose one with {base}@<split>, e.g. {base}@{available[0]}")


def drop_overlong(records: list[PromptRecord], tokenizer, prompt_length: int, mode: str = "filter",
                  what: str = "training") -> list[PromptRecord]:
    """The records whose tokenized prompt has at most `prompt_length` tokens. The longer ones are
    dropped with one warning when `mode` is "filter" and are a ValueError when it is "error"; so
    is a list in which none fits."""
    lengths = [len(tokenizer(r.prompt)["input_ids"]) for r in records]
    kept = [r for r, n in zip(records, lengths) if n <= prompt_length]
    too_long = [(r.id, n) for r, n in zip(records, lengths) if n > prompt_length]
    if not too_long:
        return kept
    examples = ", ".join(f"{i!r} ({n} tokens)" for i, n in too_long[:3])
    msg = (f"{len(too_long)} of {len(records)} {what} prompts are longer than prompt_length={prompt_length} "
           f"tokens, e.g. {examples}")
    if not kept:
        raise ValueError(f"{msg}; none is left: raise prompt_length")
    if mode == "error":
        raise ValueError(f"{msg}; raise prompt_length, or set data.overlong=filter to drop them")
    logging.getLogger(__name__).warning("%s; dropped them (data.overlong=filter)", msg)
    return kept


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


def sft_examples(tokenizer, records: list[PromptRecord]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, label ids + EOS) pairs of the labelled records: supervised warm-start data
    and the PTX loss's examples."""
    out = []
    for r in records:
        if r.label is None:
            continue
        p = tokenizer(r.prompt)["input_ids"]
        a = tokenizer(r.label, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        out.append((p, a))
    return out
