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
    """An ensemble that would mix with what reward_model.out holds already (a single model, or an
    ensemble of another size): refused. One model trained into a folder is what is served from it
    after (an ensemble's index there is removed), as is an ensemble of the same size trained again."""
    from pathlib import Path

    from ...common.reward_model_dir import is_ensemble, members

    out = Path(rc.out)
    if rc.ensemble == 1 or not ((out / "config.json").exists() or is_ensemble(out)):
        return None
    if not is_ensemble(out):
        held = "one reward model"
    else:
        try:
            size = len(members(out))
        except ValueError:
            size = 0
        if size == rc.ensemble:
            return None
        held = f"an ensemble of {size}" if size else "a broken ensemble index"
    return (
        f"{out} already holds {held}; an ensemble of {rc.ensemble} written into it would mix with it: give "
        "another --out, or remove the folder first"
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
