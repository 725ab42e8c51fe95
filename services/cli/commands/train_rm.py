"""`rlhf train-rm`: a reward model trained on preference pairs (the reward_model section)."""

from __future__ import annotations

from ...training.data import source_problem
from ..shared import USER_ERRORS, add_config_args, error, load_config, run_dir_problem


def add_parser(sub) -> None:
    p = sub.add_parser("train-rm", help="train a reward model on preference pairs (the reward_model section)")
    add_config_args(p)
    p.add_argument("--out", dest="rm_out", help="where the reward model is written (reward_model.out)")
    p.set_defaults(func=cmd_train_rm)


def cmd_train_rm(args) -> int:
    cfg = load_config(args)
    problem = _data_problem(cfg.reward_model) or run_dir_problem(cfg.reward_model.out) or _out_problem(cfg.reward_model)
    if problem:
        return error(problem)
    from ...reward_model.train import train_reward_model

    try:
        train_reward_model(cfg, say=lambda line: print(line, flush=True))
    except USER_ERRORS as e:
        return error(e)
    return 0


def _out_problem(rc) -> str | None:
    """A reward model of another shape already in reward_model.out (a single model where an
    ensemble would go, or an ensemble of another size): training would mix the two in one folder."""
    from pathlib import Path

    from ...common.reward_model_dir import is_ensemble, members

    out = Path(rc.out)
    if not (out / "config.json").exists() and not is_ensemble(out):
        return None
    try:
        held = len(members(out)) if is_ensemble(out) else 1
    except ValueError:
        held = 0
    shape = "one reward model" if held == 1 else f"an ensemble of {held}" if held else "a broken ensemble index"
    if held == rc.ensemble and (held == 1) == (not is_ensemble(out)):
        return None  # the same shape: trained again in place
    wanted = "one reward model" if rc.ensemble == 1 else f"an ensemble of {rc.ensemble}"
    return (
        f"{out} already holds {shape}; {wanted} written into it would mix with it: give another --out, "
        "or remove the folder first"
    )


def _data_problem(rc) -> str | None:
    """What is wrong with reward_model.train and reward_model.eval (the pairs), or None."""
    errors = [
        f"reward_model.{k}: {problem}"
        for k in ("train", "eval")
        if getattr(rc, k) is not None
        for problem in [source_problem(getattr(rc, k))]
        if problem
    ]
    if rc.train is None:
        errors.append("reward_model.train: not set; give the preference pairs (a .jsonl, .parquet or hf: source)")
    return "; ".join(errors) or None
