"""An environment's own prompts (data.train / data.eval `verifiers`): the rows rollout.environment's
environment brings (common/environments.py: its kind's `records`), its held-out prompts its
eval_dataset, else a split of its dataset that training never sees."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ...common import environments
from ...common.types import PromptRecord
from .kind import SourceKind
from .records import split_held_out

if TYPE_CHECKING:
    from ...common.config import Config

log = logging.getLogger("services.training.data")  # its lines read as the data loader's, as before


def problem(source: str) -> str | None:
    return None  # config.py checks that rollout.environment names an environment that brings them


def prompts(source: str, split: str, options) -> list[PromptRecord]:
    raise ValueError(
        f"{source!r} takes the prompts of rollout.environment's environment: give it as data.train or "
        "data.eval of a run whose rollout.environment names one"
    )


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


KIND = SourceKind(
    "environment",
    "verifiers (with rollout.environment a verifiers environment)",
    lambda s: s in environments.sources(),
    problem,
    prompts=prompts,
    run_prompts=environment_prompts,
)
