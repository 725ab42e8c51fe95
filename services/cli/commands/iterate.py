"""`rlhf iterate`: iterated RLHF, rounds of pairs from the current policy, the reward model trained
on them, PPO against it (services/reward_model/iterate.py)."""

from __future__ import annotations

from pathlib import Path

from ..shared import USER_ERRORS, add_config_args, error, load_config


def add_parser(sub) -> None:
    p = sub.add_parser(
        "iterate",
        help="iterated RLHF: rounds of (pairs from the current policy, judged -> the reward model trained "
        "on them -> PPO against it); the same command goes on where it stopped",
    )
    add_config_args(p)
    p.add_argument("--run-dir", help="where every round's pairs, reward model, policy and the PPO run go (run.run_dir)")
    p.add_argument("--local", action="store_true", help="PPO as `rlhf train --local` (default: `rlhf up`)")
    p.set_defaults(func=cmd_iterate)


def cmd_iterate(args) -> int:
    cfg = load_config(args, data=True, sampler=True, judge=True)  # the reward model is what the rounds train
    from ...reward_model.iterate import Rounds, iterate_problem

    problem = iterate_problem(cfg)
    if problem:
        return error(problem)
    run_dir = Path(args.run_dir or cfg.run.run_dir)
    try:
        Rounds(cfg, run_dir, args.local, say=lambda line: print(line, flush=True)).run()
    except (*USER_ERRORS, RuntimeError) as e:  # RuntimeError: a PPO round that stopped
        return error(e)
    return 0
