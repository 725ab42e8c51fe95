"""reasoning-gym tasks as prompts, `reasoning-gym:NAME[?size=N&seed=S&OPTION=VALUE...]`
(common/reasoning_gym_tasks.py: the syntax, the items, the scorer): each item's question as the
prompt, its answer as the label, what the `reasoning_gym` rule needs in metadata. Its held-out
items come from another seed, none with a training item's question."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ...common import reasoning_gym_tasks as gym
from ...common.types import PromptRecord
from .kind import SourceKind
from .records import PromptOptions, label_text, render_prompt

if TYPE_CHECKING:
    from ...common.config import Config

log = logging.getLogger("services.training.data")  # its lines read as the data loader's, as before


def problem(source: str) -> str | None:
    return gym.source_problem(source)


def prompts(source: str, split: str, options: PromptOptions) -> list[PromptRecord]:
    """The source's items of `split` (its own seed; at most `options.limit`)."""
    o = options
    return task_prompts(source, split, o.tokenizer, o.limit, o.chat_template, o.system_prompt, o.instruction)[0]


def run_prompts(cfg: Config, source: str, split: str, tokenizer) -> list[PromptRecord]:
    """A run's training items, or its held-out ones (never a training item's question)."""
    return task_held_out(cfg, source, tokenizer) if split == "eval" else task_training(cfg, source, tokenizer)


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


KIND = SourceKind(
    "reasoning-gym",
    "reasoning-gym:TASK[?size=N&seed=S&OPTION=VALUE...]",
    gym.is_task_source,
    problem,
    prompts=prompts,
    run_prompts=run_prompts,
)
