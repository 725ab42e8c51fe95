"""reasoning-gym tasks as a prompt source: `reasoning-gym:NAME[?KEY=VALUE&...]` in `data.train` /
`data.eval`, and what the `reasoning_gym` reward rule needs to score a response with the task's
own `score_answer`.

    reasoning-gym:leg_counting
    reasoning-gym:basic_arithmetic?size=500&seed=3&max_terms=3&operators=[+,-]

The options after `?` are `size` (the items of the dataset, default 1000: all of them are trained
on; the held-out set is its first `data.eval_size` items that ask no training question), `seed`
(default 0; the held-out items of a task take the training seed + 1 000 003 unless their own is
given) and the task's own configuration (the fields of its config dataclass:
`reasoning_gym.create_dataset(NAME, seed=..., size=..., **config)`). Each value is read as YAML,
as `--set` values are: `3`, `0.5`, `true`, `[+, -]`.

Each item becomes a prompt record whose metadata carries, under `reasoning_gym`, the task, seed,
size, index and config it came from and the item's own metadata (tuples and dicts with keys that
are not strings tagged so that a JSON round trip gives them back as they were): what the rule
rebuilds the item from to score it, across the replay buffer and the reward service's gRPC.

The reasoning-gym package (the `tasks` extra) is imported only when such a source or the rule is
used; it is not needed to load any other configuration.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import logging
import math
import re
from dataclasses import dataclass
from typing import Any, Iterator, TypeGuard

import yaml

log = logging.getLogger(__name__)

PREFIX = "reasoning-gym:"
METADATA_KEY = "reasoning_gym"
DEFAULT_SIZE = 1000
DEFAULT_SEED = 0
HELD_OUT_SEED_OFFSET = 1_000_003  # the held-out items' seed, past the training seed
INSTALL = "pip install 'rlhf-services[tasks]' (reasoning-gym)"
# an item's metadata larger than this (as JSON) is not carried: the rule generates the item again
MAX_ENTRY_CHARS = 32 * 1024
# tasks whose items, in reasoning-gym 0.1.25, depend on Python's string hashing (PYTHONHASHSEED):
# another process generates other items from the same seed
HASH_SEEDED = frozenset(
    {"isomorphic_strings", "list_functions", "polynomial_multiplication", "ransom_note", "word_ladder"}
)
# needs a list of datasets as config objects, which a source string cannot give
UNSUPPORTED = {"composite": "it mixes other tasks through config objects; name each task as its own source"}
RESERVED = ("size", "seed")
_TUPLE, _ITEMS = "__tuple__", "__items__"


@dataclass(frozen=True)
class TaskSource:
    """A parsed `reasoning-gym:` source: the task, its size and seed when given, and its config."""

    task: str
    size: int | None = None
    seed: int | None = None
    config_json: str = "{}"  # the task's config options, as sorted JSON (hashable)

    @property
    def config(self) -> dict:
        return json.loads(self.config_json)


def is_task_source(source: object) -> TypeGuard[str]:
    """`source` is a `reasoning-gym:` source."""
    return isinstance(source, str) and source.startswith(PREFIX)


def parse_source(source: str) -> TaskSource:
    """`reasoning-gym:NAME[?KEY=VALUE&...]` -> TaskSource; ValueError saying what is wrong with its
    syntax (not whether the task exists: `source_problem`)."""
    if not is_task_source(source):
        raise ValueError(f"not a reasoning-gym source: {source!r}")
    task, _, query = source[len(PREFIX) :].partition("?")
    task = task.strip()
    if not task:
        raise ValueError(f"{source!r} names no task: give reasoning-gym:NAME, e.g. {PREFIX}leg_counting")
    options: dict[str, Any] = {}
    for part in query.split("&") if query else []:
        key, eq, raw = part.partition("=")
        key = key.strip()
        if not key or not eq or not raw.strip():
            raise ValueError(f"{source!r}: option {part!r} is not KEY=VALUE (options are ?KEY=VALUE&KEY=VALUE)")
        if key in options:
            raise ValueError(f"{source!r}: option {key!r} is given twice")
        try:
            options[key] = yaml.safe_load(raw)
        except yaml.YAMLError:
            raise ValueError(f"{source!r}: the value of {key!r} is not valid YAML: {raw!r}") from None
    size, seed = options.pop("size", None), options.pop("seed", None)
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
        raise ValueError(f"{source!r}: size must be a whole number >= 1, not {size!r}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise ValueError(f"{source!r}: seed must be a whole number >= 0, not {seed!r}")
    try:
        config_json = json.dumps(options, sort_keys=True)
    except TypeError:
        raise ValueError(f"{source!r}: an option's value is neither a number, a string, a list nor a mapping") from None
    return TaskSource(task, size, seed, config_json)


def available() -> bool:
    """Whether the reasoning-gym package is installed."""
    try:
        _factory()
    except ImportError:
        return False
    return True


def _factory():
    import reasoning_gym.factory

    return reasoning_gym.factory


@functools.lru_cache(maxsize=1)
def task_names() -> tuple[str, ...]:
    """Every task reasoning-gym registers, sorted (ImportError without the package)."""
    return tuple(sorted(_factory().DATASETS))


def unknown_task(task: str) -> str:
    """The message for a task reasoning-gym does not have: the closest names, and a few others."""
    names = task_names()
    close = difflib.get_close_matches(task, names, n=3, cutoff=0.6)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    some = ", ".join(n for n in ("leg_counting", "basic_arithmetic", "chain_sum", "gsm_symbolic", "spell_backward"))
    return f"unknown reasoning-gym task {task!r}; {hint}{len(names)} tasks, e.g. {some}"


def source_problem(source: str, need_package: bool = True) -> str | None:
    """Why `source` cannot be generated, as far as that shows without generating it: its syntax,
    the package missing (only with `need_package`: a config loads without it), an unknown task, a
    config option the task has not or a value its config refuses. None when fine."""
    try:
        spec = parse_source(source)
    except ValueError as e:
        return str(e)
    if spec.task in UNSUPPORTED:
        return f"reasoning-gym task {spec.task!r} cannot be a source: {UNSUPPORTED[spec.task]}"
    if not available():
        return f"{source} needs the reasoning-gym package: {INSTALL}" if need_package else None
    if spec.task not in task_names():
        return unknown_task(spec.task)
    return _config_problem(spec.task, spec.config_json)


@functools.lru_cache(maxsize=256)
def _config_problem(task: str, config_json: str) -> str | None:
    _, config_cls = _factory().DATASETS[task]
    fields = [f.name for f in dataclasses.fields(config_cls) if f.name not in RESERVED]
    config = json.loads(config_json)
    unknown = sorted(set(config) - set(fields))
    if unknown:
        return f"reasoning-gym task {task!r} has no option {', '.join(map(repr, unknown))}; its options: " + (
            ", ".join(["size", "seed", *fields])
        )
    try:
        made = config_cls(**config, seed=DEFAULT_SEED, size=1)
        if callable(getattr(made, "validate", None)):
            made.validate()
    except Exception as e:  # the task's own checks (assertions, mostly)
        return f"reasoning-gym task {task!r} refuses its config {config}: {type(e).__name__}: {e}"
    return None


@functools.lru_cache(maxsize=32)
def dataset(task: str, seed: int, size: int, config_json: str = "{}"):
    """The task's dataset, made once per process for each (task, seed, size, config)."""
    if task in HASH_SEEDED:
        log.warning(
            "reasoning-gym task %s generates items that depend on Python's string hashing: set PYTHONHASHSEED "
            "for the same items in every process (a resumed run, a second learner)",
            task,
        )
    return _factory().create_dataset(task, seed=seed, size=size, **json.loads(config_json))


@functools.lru_cache(maxsize=16)
def items(task: str, seed: int, size: int, config_json: str = "{}") -> tuple[dict, ...]:
    """The task's `size` items from `seed` (question, answer, metadata), generated once per process."""
    ds = dataset(task, seed, size, config_json)
    return tuple(ds[i] for i in range(size))


def generate(task: str, seed: int, size: int, config_json: str = "{}") -> Iterator[dict]:
    """The task's items from `seed` one at a time, as they are taken (the held-out items: as many as
    are kept, not `size`)."""
    ds = dataset(task, seed, size, config_json)
    for i in range(size):
        yield ds[i]


def to_json(value: Any) -> Any:
    """`value` with tuples and dicts whose keys are not all strings tagged, so that `from_json` of
    its JSON round trip gives it back; TypeError for what JSON cannot hold."""
    if isinstance(value, tuple):
        return {_TUPLE: [to_json(v) for v in value]}
    if isinstance(value, list):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not ({_TUPLE, _ITEMS} & set(value)):
            return {k: to_json(v) for k, v in value.items()}
        return {_ITEMS: [[to_json(k), to_json(v)] for k, v in value.items()]}
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    raise TypeError(f"{type(value).__name__} {value!r:.40} has no JSON form")


def from_json(value: Any) -> Any:
    """The inverse of `to_json`."""
    if isinstance(value, list):
        return [from_json(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {_TUPLE}:
            return tuple(from_json(v) for v in value[_TUPLE])
        if set(value) == {_ITEMS}:
            return {_hashable(from_json(k)): from_json(v) for k, v in value[_ITEMS]}
        return {k: from_json(v) for k, v in value.items()}
    return value


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def record_metadata(spec: TaskSource, seed: int, size: int, index: int, entry: dict) -> dict:
    """What a prompt record of item `index` carries for the rule: under METADATA_KEY, the task,
    seed, size, index, config and the item's own metadata (tagged by `to_json`; left out when it
    has no JSON form or is over MAX_ENTRY_CHARS, and then generated again to score)."""
    carried = {"task": spec.task, "seed": seed, "size": size, "index": index, "config": spec.config}
    try:
        meta = to_json(entry.get("metadata", {}))
        if len(json.dumps(meta)) <= MAX_ENTRY_CHARS:
            carried["metadata"] = meta
    except TypeError:
        pass
    return {METADATA_KEY: carried}


def extract_answer(response: str, tag: str = "answer", require_tag: bool = False) -> str | None:
    """The answer in a response as reasoning-gym's scorers expect it: the content of the last
    `<tag>...</tag>`, stripped (as reasoning_gym.utils.extract_answer finds it); after an opening
    `<tag>` that was never closed (the response cut off), what follows it; with no tag, the whole
    response, stripped, or None when `require_tag`."""
    found = re.findall(f"<{tag}>\\s?(.*?)\\s?</{tag}>", response, flags=re.DOTALL)
    if found:
        return found[-1].strip()
    opening = f"<{tag}>"
    if opening in response:
        return response.rsplit(opening, 1)[1].strip()
    return None if require_tag else response.strip()


_warned: set[tuple[str, str]] = set()


def score(answer: str | None, label: str | None, carried: dict) -> float:
    """The task's own `score_answer` of `answer` for the item `carried` (the METADATA_KEY part of a
    record's metadata) describes, on a dataset made with the item's config (some scorers read it).
    A scorer that raises on what a model wrote (a parse it did not expect) scores 0.0, with one
    warning per task and exception type."""
    task = carried["task"]
    config_json = json.dumps(carried.get("config") or {}, sort_keys=True)
    try:
        ds = dataset(task, int(carried["seed"]), int(carried["size"]), config_json)
    except ImportError:
        raise ValueError(f"scoring reasoning-gym task {task} needs the reasoning-gym package here: {INSTALL}") from None
    if "metadata" in carried:
        entry = {"question": "", "answer": label, "metadata": from_json(carried["metadata"])}
    else:
        entry = ds[int(carried["index"])]
        if label is not None and entry["answer"] != label:
            raise ValueError(
                f"reasoning-gym task {task} gave another item {carried['index']} in this process than the one "
                "trained on (its items depend on PYTHONHASHSEED: set it for every process)"
            )
    try:
        value = float(ds.score_answer(answer, entry))
    except Exception as e:
        if (task, type(e).__name__) not in _warned:
            _warned.add((task, type(e).__name__))
            log.warning("reasoning-gym's %s scorer raised %s on an answer (%.80r): scored 0.0", task, e, answer)
        return 0.0
    return value if math.isfinite(value) else 0.0


def default_score(answer: str | None, label: str) -> float:
    """reasoning-gym's scorer for a task without one of its own: 1.0 for the label exactly, the
    label's share of the answer's length when the answer contains it, else 0.0."""
    if not answer:
        return 0.0
    if answer == label:
        return 1.0
    return len(label) / len(answer) if label in answer else 0.0
