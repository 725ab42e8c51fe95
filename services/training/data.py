"""A run's prompts, from whichever source data.train and data.eval name (sources/: one module a
kind, one registry: synthetic tasks, reasoning-gym tasks, an environment's own prompts, Hugging
Face `datasets` sources, JSON lines files): `load_prompts` and `read_rows` for any command,
`config_prompts` for a run (its held-out prompts a split of data.train's, the source's own, or
data.eval's; prompts longer than prompt_length dropped or refused), the pre-flight's checks of a
source (`data_source_errors`), the epoch sampler, and the supervised warm start's examples.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from ..common import environments
from ..common.types import STRUCTURED_LABEL, PromptRecord
from . import sources
from .sources import jsonl, synthetic
from .sources.records import PromptOptions, fields, record_of, split_held_out

if TYPE_CHECKING:
    from ..common.config import Config

log = logging.getLogger(__name__)


def source_problem(source: str) -> str | None:
    """Why `source` cannot be loaded, as far as that shows offline (its kind's check: an unknown
    synthetic task, a local file or `hf:` dataset directory that does not exist, a reasoning-gym
    task or option that is unknown); None otherwise; hub dataset names are not checked."""
    return sources.problem(source)


def load_prompts(
    source: str,
    split: str,
    tokenizer=None,
    prompt_key: str = "prompt",
    label_key: str = "label",
    limit: int | None = None,
    seed: int = 0,
    chat_template: bool = False,
    system_prompt: str | None = None,
    instruction: str | None = None,
) -> list[PromptRecord]:
    """Load prompt records from `synthetic:<task>`, a JSON lines file, or a Hugging Face `datasets`
    source: `hf:<name>[:<config>][@<split>]` (a hub dataset or a local dataset directory) or a
    `.parquet`, `.csv` or `.json` file. The default split is the `split` argument; an `hf:` source
    without one takes the first of sources/hf.py:SPLIT_CHOICES[split] it has (eval: eval, test, validation, valid).
    `chat_template`, `system_prompt` and `instruction` apply to string prompts as in `render_prompt`.
    A `reasoning-gym:` source gives its items (`seed` is the source's own)."""
    options = PromptOptions(tokenizer, prompt_key, label_key, limit, seed, chat_template, system_prompt, instruction)
    kind = sources.kind_of(source)
    if kind.rows is None:
        assert kind.prompts is not None
        return kind.prompts(source, split, options)
    return [record_of(row, where, options) for where, row in kind.rows(source, split, limit)]


def read_rows(source: str, split: str, limit: int | None = None) -> list[tuple[str, dict]]:
    """The rows of a JSON lines file or a Hugging Face `datasets` source (`hf:<name>[:<config>][@<split>]`,
    a `.parquet`, `.csv` or `.json` file), each with where it came from (`file.jsonl:LINE`,
    `name:INDEX`): what prompt and preference records are read from."""
    kind = sources.kind_of(source)
    if kind.rows is None:
        raise ValueError(f"{source}: a {kind.name} source makes its prompts; it has no rows to read")
    return kind.rows(source, split, limit)


def is_jsonl(source: str) -> bool:
    """`source` is read as a JSON lines file (of no other kind)."""
    return sources.kind_of(source) is jsonl.KIND


def first_problems(problems: list[str], most: int = 5) -> list[str]:
    """The first `most` problems, and how many more there are."""
    return problems[:most] + ([f"... and {len(problems) - most} more"] if len(problems) > most else [])


def config_prompts(cfg: Config, split: str, tokenizer, label_reader: str | None = None) -> list[PromptRecord]:
    """The run's training (`split` "train") or held-out ("eval") prompts as its `data` section
    says, those longer than `prompt_length` tokens dropped (or an error: `data.overlong`). With
    `data.eval` unset, the held-out prompts are a split of `data.train` that training never sees
    (`split_held_out`); a synthetic task has held-out prompts of its own, and so has a reasoning-gym
    task (sources/reasoning_gym.py: `task_held_out`). `label_reader`: the part of the reward that reads labels
    (reward/labels.py), when the caller knows it: records without one are then an error."""
    d = cfg.data
    held_out = split == "eval"
    from_train = d.eval is None and not sources.kind_of(d.train).own_held_out
    source = d.eval if held_out and d.eval is not None else d.train
    kind = sources.kind_of(source)
    what = "held-out" if held_out else "training"
    if kind.run_prompts is not None:  # its own for a run: an environment's, a reasoning-gym task's items
        records = kind.run_prompts(cfg, source, split, tokenizer)
        return drop_overlong(records, tokenizer, cfg.prompt_length, d.overlong, what)
    records = load_prompts(
        source,
        "train" if from_train else split,
        tokenizer,
        d.prompt_key,
        d.label_key,
        limit=d.eval_size if held_out and not from_train else None,
        seed=cfg.run.seed,
        chat_template=d.chat_template,
        system_prompt=d.system_prompt,
        instruction=d.instruction,
    )
    if kind.rows is not None:  # a generated task's labels are its answers
        _check_labels(cfg, "eval" if held_out and d.eval is not None else "train", source, records, label_reader)
    if from_train:
        train, held = split_held_out(records, d.eval_size, d.train)
        if held_out:
            log.info(
                "data.eval is not set: %d of the %d prompts of %s are held out for evaluation (chosen by a "
                "hash of the prompt text) and never trained on",
                len(held),
                len(records),
                d.train,
            )
        records = held if held_out else train
    return drop_overlong(records, tokenizer, cfg.prompt_length, d.overlong, what=what)


def _check_labels(cfg: Config, key: str, source: str, records: list[PromptRecord], reader: str | None) -> None:
    """A ValueError naming data.KEY when no record of `source` has a label and the reward reads one."""
    rows = [(_record_keys(r, cfg.data.prompt_key), r.label is not None) for r in records]
    for problem in missing_labels(cfg, source, rows, reader):
        raise ValueError(f"data.{key}: {problem}")


def _record_keys(record: PromptRecord, prompt_key: str) -> list[str]:
    """The fields a record was read from, as far as it keeps them: its prompt and its metadata."""
    return [prompt_key, *(k for k in record.metadata if k != STRUCTURED_LABEL)]


def held_out_source(cfg: Config) -> str:
    """Where the held-out prompts come from, in words: data.eval, or the held-out split of data.train."""
    d = cfg.data
    if (d.eval or d.train) in environments.sources():
        ref = cfg.rollout.environment or ""
        return f"the {environments.kind_of(ref).name} environment {ref} (its held-out prompts)"
    if d.eval is not None or sources.kind_of(d.train) is synthetic.KIND:
        return d.eval or d.train
    if sources.kind_of(d.train).own_held_out:
        return f"{d.train} (its held-out items)"
    return f"{d.train} (its held-out split)"


def drop_overlong(
    records: list[PromptRecord], tokenizer, prompt_length: int, mode: str = "filter", what: str = "training"
) -> list[PromptRecord]:
    """The records whose tokenized prompt has at most `prompt_length` tokens. The longer ones are
    dropped with one warning when `mode` is "filter" and are a ValueError when it is "error"; so
    is a list in which none fits."""
    lengths = [len(tokenizer(r.prompt)["input_ids"]) for r in records]
    kept = [r for r, n in zip(records, lengths) if n <= prompt_length]
    too_long = [(r.id, n) for r, n in zip(records, lengths) if n > prompt_length]
    if not too_long:
        return kept
    examples = ", ".join(f"{i!r} ({n} tokens)" for i, n in too_long[:3])
    msg = (
        f"{len(too_long)} of {len(records)} {what} prompts are longer than prompt_length={prompt_length} "
        f"tokens, e.g. {examples}"
    )
    if not kept:
        raise ValueError(f"{msg}; none is left: raise prompt_length")
    if mode == "error":
        raise ValueError(f"{msg}; raise prompt_length, or set data.overlong=filter to drop them")
    log.warning("%s; dropped them (data.overlong=filter)", msg)
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
        return {"epoch": self.epoch, "order": list(self._order), "started": self._started, "rng": self.rng.getstate()}

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


def data_source_errors(cfg: Config, label_reader: str | None = None) -> list[str]:
    """Data sources that cannot be read here (a missing file or dataset directory, an unknown
    synthetic task) or trained on (`prompt_source_problems`). Checked by the commands that read the
    data (`config validate`, `train`, `up`, `serve learner`), not by every service: a generation
    server needs no prompt files. `label_reader` as in `config_prompts`."""
    errors = []
    for key in ("train", "eval"):
        source = getattr(cfg.data, key)
        if source is not None:
            errors += [f"data.{key}: {problem}" for problem in prompt_source_problems(cfg, source, label_reader)]
    return errors


def prompt_source_problems(cfg: Config, source: str, label_reader: str | None = None) -> list[str]:
    """Why the prompts of `source` cannot be trained on, as far as reading them here shows: it does
    not exist; in a JSON lines file, lines that are no JSON object or records without a prompt
    (each as FILE:LINE); no record with a label when the reward reads labels."""
    problem = source_problem(source)
    if problem or not is_jsonl(source):
        return [problem] if problem else []
    rows, problems = jsonl.jsonl_rows(source)
    d = cfg.data
    problems += [f"{where}: {e}" for where, row in rows for e in [_prompt_problem(row, d.prompt_key)] if e]
    labels = [(list(row), _has_label(row, d.prompt_key, d.label_key)) for _, row in rows]
    return first_problems(problems) + missing_labels(cfg, source, labels, label_reader)


def _prompt_problem(record: dict, prompt_key: str) -> str | None:
    """Why `record` gives no prompt, or None."""
    try:
        prompt, _, _ = fields(record, prompt_key, "label")
    except ValueError as e:
        return str(e)
    return "its prompt is null" if prompt is None else None


def _has_label(record: dict, prompt_key: str, label_key: str) -> bool:
    try:
        return fields(record, prompt_key, label_key)[1] is not None
    except ValueError:
        return False


# fields that often hold the reference answer: the one suggested as data.label_key, in this order
LABEL_FIELDS = ("answer", "target", "output", "reference", "ground_truth", "gold", "expected", "completion", "response")
NOT_LABELS = frozenset({"id", "messages", "data_source", "extra_info", "reward_model"})


def missing_labels(cfg: Config, source: str, rows: list[tuple[list[str], bool]], reader: str | None) -> list[str]:
    """The problem of a source whose records (each: its keys, whether it has a label) give no label
    while `reader`, the part of the reward that reads labels (reward/labels.py: label_reader), is
    set; [] otherwise."""
    if reader is None:
        return []
    d = cfg.data
    problem = label_problem(_source_name(source), rows, d.prompt_key, d.label_key)
    return [problem] if problem is not None else []


def label_problem(name: str, rows: list[tuple[list[str], bool]], prompt_key: str, label_key: str) -> str | None:
    """Why no record of `name` gives a label (each row: its keys, whether it has a label): the keys
    the records have, and the one to name as data.label_key; None when one has a label."""
    if not rows or any(labelled for _, labelled in rows):
        return None
    keys = list(dict.fromkeys(k for ks, _ in rows for k in ks))
    shown = ", ".join(keys[:12]) + (f", ... ({len(keys)} keys)" if len(keys) > 12 else "")
    return f"no record of {name} has `{label_key}`; keys found: {shown}; {_label_hint(keys, prompt_key)}"


def _label_hint(keys: list[str], prompt_key: str) -> str:
    others = [k for k in keys if k != prompt_key and k not in NOT_LABELS]
    guess = next((k for k in LABEL_FIELDS if k in others), others[0] if len(others) == 1 else None)
    return f"set data.label_key={guess}" if guess else "set data.label_key to the field with the reference answer"


def _source_name(source: str) -> str:
    """A source as a message names it: a file by its name, anything else as it is."""
    return Path(source).name if sources.kind_of(source).rows is not None and not source.startswith("hf:") else source
