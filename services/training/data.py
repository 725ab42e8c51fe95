"""Prompt datasets: JSON lines files, Hugging Face `datasets` sources, or a synthetic task built
offline.

A record is `{"prompt": str}`, `{"prompt": [{"role", "content"}, ...]}` (verl's parquet) or
`{"messages": [...]}` (`prompt` stands for `prompt_key`), with an optional label, the reference
answer a rule reward checks against: the `label_key` field, else verl's
`reward_model.ground_truth`, else `solution`. GSM8K's own rows (`question`, `answer` ending in
`#### N`) give the question as prompt and N as label. Chat messages always go through the
tokenizer's chat template; string prompts do when `chat_template` is on. `synthetic:reverse` is
the tiny default task: reverse a short string of letters; `synthetic:arithmetic` asks for the sum
of two 2-digit numbers, `synthetic:multiply` for their product. Train and held-out prompts of a
synthetic task are disjoint. `reasoning-gym:NAME[?size=N&seed=S&OPTION=VALUE...]` generates a
reasoning-gym task's items (common/reasoning_gym_tasks.py): its question as the prompt, its answer as
the label; its held-out items come from another seed, none with a training item's question.
`verifiers` takes the dataset of rollout.environment's verifiers environment
(common/environments.py: the kind's `records`); its held-out prompts are its eval_dataset, else a split of it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from ..common import environments
from ..common import reasoning_gym_tasks as gym
from ..common.types import STRUCTURED_LABEL, PromptRecord

if TYPE_CHECKING:
    from ..common.config import Config

log = logging.getLogger(__name__)

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


SYNTHETIC_TASKS = {"reverse": reverse_task, "arithmetic": arithmetic_task, "multiply": multiply_task}
DATASETS_FILE_TYPES = (".parquet", ".csv", ".json")
# the dataset splits `hf:` sources fall back to, in order, when the wanted split is missing
SPLIT_CHOICES = {"train": ("train",), "eval": ("eval", "test", "validation", "valid")}


def source_problem(source: str) -> str | None:
    """Why `source` cannot be loaded, as far as that shows offline: an unknown synthetic task, or a
    local file or `hf:` dataset directory that does not exist (relative paths are taken from the
    current directory); a reasoning-gym source whose task or options are unknown, or without the
    package. None otherwise; hub dataset names are not checked."""
    if gym.is_task_source(source):
        return gym.source_problem(source)
    if source in environments.sources():  # the environment's (config.py checks rollout.environment names one)
        return None
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


def render_prompt(
    prompt: str | list,
    tokenizer,
    chat_template: bool = False,
    system_prompt: str | None = None,
    instruction: str | None = None,
) -> str:
    """The prompt text: a list of chat messages rendered through the tokenizer's chat template
    (with the generation prompt); a string (followed by `instruction`, after a space) as is, or,
    when `chat_template`, wrapped as one user message after an optional `system_prompt` message
    and rendered the same way."""
    if isinstance(prompt, str):
        if instruction:
            prompt = f"{prompt} {instruction}"
        if not chat_template:
            return prompt
        system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        prompt = system + [{"role": "user", "content": prompt}]
    if not prompt or not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
        raise ValueError(f"a list prompt must be chat messages, each {{'role', 'content'}}; got {prompt[:2]!r}")
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "chat messages need a tokenizer with a chat template to render them; "
            + ("none was given" if tokenizer is None else "this tokenizer has none")
        )
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


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
    without one takes the first of SPLIT_CHOICES[split] it has (eval: eval, test, validation, valid).
    `chat_template`, `system_prompt` and `instruction` apply to string prompts as in `render_prompt`.
    A `reasoning-gym:` source gives its items (`task_prompts`; `seed` is the source's own)."""
    if gym.is_task_source(source):
        return task_prompts(source, split, tokenizer, limit, chat_template, system_prompt, instruction)[0]
    if source.startswith("synthetic:"):
        task = source.split(":", 1)[1]
        if task not in SYNTHETIC_TASKS:
            raise ValueError(f"unknown synthetic task {task!r}; valid: {', '.join(SYNTHETIC_TASKS)}")
        records = SYNTHETIC_TASKS[task](split, limit, seed)
        if not chat_template and not instruction:
            return records
        return [
            dataclasses.replace(r, prompt=render_prompt(r.prompt, tokenizer, chat_template, system_prompt, instruction))
            for r in records
        ]
    options = dict(
        tokenizer=tokenizer,
        prompt_key=prompt_key,
        label_key=label_key,
        chat_template=chat_template,
        system_prompt=system_prompt,
        instruction=instruction,
    )
    return [_record(row, where, **options) for where, row in read_rows(source, split, limit)]


def task_prompts(
    source: str,
    split: str,
    tokenizer=None,
    limit: int | None = None,
    chat_template: bool = False,
    system_prompt: str | None = None,
    instruction: str | None = None,
    default_seed: int | None = None,
    exclude: frozenset[str] = frozenset(),
    seed: int | None = None,
) -> tuple[list[PromptRecord], int]:
    """The items of a `reasoning-gym:NAME[?size=N&seed=S&OPTION=VALUE...]` source as prompt records
    (the question, rendered as string prompts are; the answer as label; what the `reasoning_gym`
    rule needs in metadata), and how many were dropped because their question is in `exclude`.
    The seed is `seed` when given (data.train's held-out items), else the source's own, else
    `default_seed`, else 0 (train) or 0 + 1000003 (eval);
    without its own size, 1000 items. With `limit`, items are generated only until `limit` records
    are kept (the held-out set: the first data.eval_size items that no training item shares)."""
    problem = gym.source_problem(source)
    if problem:
        raise ValueError(problem)
    spec = gym.parse_source(source)
    if seed is not None:
        pass
    elif spec.seed is not None:
        seed = spec.seed
    elif default_seed is not None:
        seed = default_seed
    else:
        seed = gym.DEFAULT_SEED + (gym.HELD_OUT_SEED_OFFSET if split == "eval" else 0)
    size = spec.size or gym.DEFAULT_SIZE
    records: list[PromptRecord] = []
    dropped = 0
    every = gym.items if limit is None else gym.generate  # the training set is kept for the held-out check
    for i, entry in enumerate(every(spec.task, seed, size, spec.config_json)):
        if limit is not None and len(records) >= limit:
            break
        question = str(entry["question"])
        if question in exclude:
            dropped += 1
            continue
        records.append(
            PromptRecord(
                id=f"{spec.task}-{seed}-{i}",
                prompt=render_prompt(question, tokenizer, chat_template, system_prompt, instruction),
                label=None if entry.get("answer") is None else label_text(entry["answer"]),
                metadata=gym.record_metadata(spec, seed, size, i, entry),
            )
        )
    return records, dropped


def task_questions(source: str) -> frozenset[str]:
    """The questions of a reasoning-gym source's training items (its seed, else 0; its size, else 1000)."""
    spec = gym.parse_source(source)
    seed = gym.DEFAULT_SEED if spec.seed is None else spec.seed
    return frozenset(
        str(e["question"]) for e in gym.items(spec.task, seed, spec.size or gym.DEFAULT_SIZE, spec.config_json)
    )


def read_rows(source: str, split: str, limit: int | None = None) -> list[tuple[str, dict]]:
    """The rows of a JSON lines file or a Hugging Face `datasets` source (`hf:<name>[:<config>][@<split>]`,
    a `.parquet`, `.csv` or `.json` file), each with where it came from (`file.jsonl:LINE`,
    `name:INDEX`): what prompt and preference records are read from."""
    if source.startswith("hf:") or source.endswith(DATASETS_FILE_TYPES):
        return _from_datasets(source, split, limit)
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"data file {path} does not exist")
    out = []
    for lineno, line in _lines(path):
        out.append((f"{path.name}:{lineno}", _parsed(path, lineno, line)))
        if limit is not None and len(out) >= limit:
            break
    return out


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


def is_jsonl(source: str) -> bool:
    """`source` is read as a JSON lines file (not synthetic:, hf:, reasoning-gym: or a `datasets` file type)."""
    return (
        not source.startswith(("synthetic:", "hf:", gym.PREFIX))
        and not source.endswith(DATASETS_FILE_TYPES)
        and source not in environments.sources()
    )


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


def first_problems(problems: list[str], most: int = 5) -> list[str]:
    """The first `most` problems, and how many more there are."""
    return problems[:most] + ([f"... and {len(problems) - most} more"] if len(problems) > most else [])


def gsm8k_label(answer: str) -> str:
    """The final answer of a GSM8K solution: the number after its `####`, commas removed
    ("... #### 1,234" -> "1234"); the whole answer, stripped, when it has no `####`."""
    _, mark, final = str(answer).rpartition("####")
    return (final if mark else str(answer)).strip().replace(",", "")


def _fields(record: dict, prompt_key: str, label_key: str) -> tuple[object, object, set[str]]:
    """(prompt, label, the keys consumed) of a row in any of the formats of the module docstring."""
    messages = record.get("messages")
    if messages is None and prompt_key not in record:
        if "question" in record and "answer" in record:
            return record["question"], gsm8k_label(record["answer"]), {"question", "answer"}
        raise ValueError(
            f"record has neither {prompt_key!r} nor 'messages' (nor GSM8K's 'question' and 'answer'): {sorted(record)}"
        )
    reward_model = record.get("reward_model")
    truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    label = next((v for v in (record.get(label_key), truth, record.get("solution")) if v is not None), None)
    used = {"messages", prompt_key, label_key, "solution"} | ({"reward_model"} if truth is not None else set())
    return (record[prompt_key] if messages is None else messages), label, used


def _record(
    record: dict,
    default_id: str,
    tokenizer,
    prompt_key: str,
    label_key: str,
    chat_template: bool,
    system_prompt: str | None,
    instruction: str | None = None,
) -> PromptRecord:
    """A row as a PromptRecord: its rendered prompt, its label, and its other fields (verl's
    `data_source` among them) as metadata."""
    prompt, label, used = _fields(record, prompt_key, label_key)
    rid = str(record.get("id", default_id))
    if prompt is None:
        raise ValueError(f"record {rid}: its prompt is null")
    metadata = {k: v for k, v in record.items() if k not in used | {"id"}}
    if isinstance(label, (dict, list)):  # kept as stored for functions that take it so (reward/functions.py)
        metadata[STRUCTURED_LABEL] = label
    return PromptRecord(
        id=rid,
        prompt=render_prompt(
            prompt if isinstance(prompt, list) else str(prompt), tokenizer, chat_template, system_prompt, instruction
        ),
        label=None if label is None else label_text(label),
        metadata=metadata,
    )


def label_text(label) -> str:
    """A label as the string rules compare: itself, a number as written, a structure as JSON."""
    if isinstance(label, str):
        return label
    if isinstance(label, (dict, list)):
        return json.dumps(label, ensure_ascii=False, default=str)
    return str(label)


def _from_datasets(source: str, split: str, limit: int | None) -> list[tuple[str, dict]]:
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
            raise FileNotFoundError(f"data file {name} does not exist")
        ds = datasets.load_dataset(Path(name).suffix.lstrip("."), data_files={want_split: name}, split=want_split)
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    label = Path(name).name
    return [(f"{label}:{i}", dict(row)) for i, row in enumerate(ds)]


def _pick_split(source: str, candidates: tuple[str, ...], available: list[str]) -> str:
    """The first of `candidates` that the dataset has."""
    for name in candidates:
        if name in available:
            return name
    base = source.partition("@")[0]
    raise ValueError(
        f"{source} has no {'/'.join(candidates)} split (it has {', '.join(available)}); "
        f"choose one with {base}@<split>, e.g. {base}@{available[0]}"
    )


def config_prompts(cfg: Config, split: str, tokenizer, label_reader: str | None = None) -> list[PromptRecord]:
    """The run's training (`split` "train") or held-out ("eval") prompts as its `data` section
    says, those longer than `prompt_length` tokens dropped (or an error: `data.overlong`). With
    `data.eval` unset, the held-out prompts are a split of `data.train` that training never sees
    (`split_held_out`); a synthetic task has held-out prompts of its own, and so has a reasoning-gym
    task (`task_held_out`). `label_reader`: the part of the reward that reads labels
    (reward/labels.py), when the caller knows it: records without one are then an error."""
    d = cfg.data
    held_out = split == "eval"
    from_train = d.eval is None and not d.train.startswith(("synthetic:", gym.PREFIX))
    source = d.eval if held_out and d.eval is not None else d.train
    if source in environments.sources():  # the prompts rollout.environment's environment brings
        records = environment_prompts(cfg, source, split, tokenizer)
        return drop_overlong(records, tokenizer, cfg.prompt_length, d.overlong, "held-out" if held_out else "training")
    if gym.is_task_source(source):  # its labels are the task's answers (or none: its scorer needs none)
        records = task_held_out(cfg, source, tokenizer) if held_out else task_training(cfg, source, tokenizer)
        return drop_overlong(records, tokenizer, cfg.prompt_length, d.overlong, "held-out" if held_out else "training")
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
    if not source.startswith("synthetic:"):
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
    return drop_overlong(records, tokenizer, cfg.prompt_length, d.overlong, what="held-out" if held_out else "training")


def environment_prompts(cfg: Config, source: str, split: str, tokenizer) -> list[PromptRecord]:
    """The training (`split` "train") or held-out ("eval") prompts of rollout.environment's
    environment, for data.train / data.eval `source` (`verifiers`: common/environments.py's
    `records`): every row of its dataset for training; held out, the first data.eval_size rows of
    its eval_dataset less any whose prompt a training row has (data.train the same source). An
    environment without an eval_dataset holds out a split of its dataset (`split_held_out`, when
    data.train is the same source too) that training never sees."""
    d, ref = cfg.data, cfg.rollout.environment or ""
    name = f"the {environments.kind_of(ref).name} environment {ref}"

    def rows(which: str, limit: int | None = None) -> list[PromptRecord] | None:
        found = environments.records(ref, which, tokenizer, limit)
        return None if found is None else [PromptRecord(**r) for r in found]

    both = d.train == source and d.eval in (None, source)
    evals = rows("eval")
    if evals is None and both:  # no eval_dataset: a split of the dataset, the same in every run
        train, held = split_held_out(rows("train") or [], d.eval_size, ref)
        if split == "eval":
            log.info("%d of the dataset's prompts of %s are held out (it has no eval_dataset)", len(held), name)
        return held if split == "eval" else train
    if split == "train":
        return rows("train") or []
    if evals is None:  # data.train another source: the dataset's first rows
        return rows("train", limit=d.eval_size) or []
    trained = {r.prompt for r in rows("train") or []} if d.train == source else set()
    kept = [r for r in evals if r.prompt not in trained]
    if len(kept) < len(evals):
        log.info("held-out rows of %s: dropped %d whose prompt a training row has", name, len(evals) - len(kept))
    if not kept:
        raise ValueError(f"every eval_dataset row of {name} has a training row's prompt: nothing is held out")
    return kept[: d.eval_size]


def task_training(cfg: Config, source: str, tokenizer) -> list[PromptRecord]:
    """The training prompts of the reasoning-gym source `source` (data.train)."""
    d = cfg.data
    return task_prompts(source, "train", tokenizer, None, d.chat_template, d.system_prompt, d.instruction)[0]


def task_held_out(cfg: Config, source: str, tokenizer) -> list[PromptRecord]:
    """The held-out prompts of the reasoning-gym source `source` (data.eval, or data.train when
    data.eval is unset): the first data.eval_size items from its own seed, else data.train's seed
    (a reasoning-gym source's, else 0) + 1000003, less any whose question a training item of
    data.train (when it is a reasoning-gym source too) asks; how many were dropped is logged."""
    d = cfg.data
    training = d.train if gym.is_task_source(d.train) else None
    train_seed = gym.parse_source(training).seed if training else None
    default_seed = (gym.DEFAULT_SEED if train_seed is None else train_seed) + gym.HELD_OUT_SEED_OFFSET
    exclude = task_questions(training) if training else frozenset()
    # data.train's own held-out items: never its training seed
    override = default_seed if d.eval is None else None
    records, dropped = task_prompts(
        source,
        "eval",
        tokenizer,
        d.eval_size,
        d.chat_template,
        d.system_prompt,
        d.instruction,
        default_seed=default_seed,
        exclude=exclude,
        seed=override,
    )
    what = f"{source} (seed {records[0].metadata[gym.METADATA_KEY]['seed']})" if records else source
    if dropped:
        log.info("held-out items of %s: dropped %d whose question a training item of %s asks", what, dropped, training)
    if not records:
        raise ValueError(
            f"every held-out item of {source} asks a question a training item of {training} asks: "
            "give the task a config with more distinct questions, or fewer training items (size=N)"
        )
    if d.eval is None:
        log.info("data.eval is not set: %d held-out items of %s, none asking a training question", len(records), what)
    return records


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
    if d.eval is not None or d.train.startswith("synthetic:"):
        return d.eval or d.train
    if gym.is_task_source(d.train):
        return f"{d.train} (its held-out items)"
    return f"{d.train} (its held-out split)"


def split_held_out(
    records: list[PromptRecord], eval_size: int, source: str = "data.train"
) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """(training, held-out) records of one dataset: the held-out ones are the `eval_size` (at most a
    fifth of the distinct prompts) whose prompt text hashes lowest, so the split is the same in
    every run, for every seed and record order; a prompt repeated in the data is held out once, or
    trained on in every copy."""
    texts = sorted({r.prompt for r in records}, key=lambda t: (zlib.crc32(t.encode()), t))
    n = min(eval_size, len(texts) // 5)
    if n == 0:
        raise ValueError(
            f"{source} has {len(texts)} distinct prompts, too few to hold out a fifth for evaluation; "
            "set data.eval to a held-out set"
        )
    held_texts = set(texts[:n])
    first: dict[str, PromptRecord] = {}  # one held-out record per prompt
    for r in records:
        if r.prompt in held_texts:
            first.setdefault(r.prompt, r)
    held = [first[t] for t in texts[:n]]
    return [r for r in records if r.prompt not in held_texts], held


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
    rows, problems = jsonl_rows(source)
    d = cfg.data
    problems += [f"{where}: {e}" for where, row in rows for e in [_prompt_problem(row, d.prompt_key)] if e]
    labels = [(list(row), _has_label(row, d.prompt_key, d.label_key)) for _, row in rows]
    return first_problems(problems) + missing_labels(cfg, source, labels, label_reader)


def _prompt_problem(record: dict, prompt_key: str) -> str | None:
    """Why `record` gives no prompt, or None."""
    try:
        prompt, _, _ = _fields(record, prompt_key, "label")
    except ValueError as e:
        return str(e)
    return "its prompt is null" if prompt is None else None


def _has_label(record: dict, prompt_key: str, label_key: str) -> bool:
    try:
        return _fields(record, prompt_key, label_key)[1] is not None
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
    return source if source.startswith(("hf:", "synthetic:", gym.PREFIX)) else Path(source).name
