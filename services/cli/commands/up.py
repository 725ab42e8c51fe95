"""`rlhf up`: the whole system on localhost (embedded Redis and every service, services/launcher.py)."""

from __future__ import annotations

import argparse

from ...common.checkpoints import Mode
from ..rundir import run_dir_conflict
from ..shared import RESUME_HELP, USER_ERRORS, add_config_args, error, load_config, run_dir_problem


def add_parser(sub) -> None:
    p = sub.add_parser(
        "up",
        help="run the whole system on localhost: embedded Redis and every service",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=RESUME_HELP,
    )
    add_config_args(p)
    p.add_argument(
        "--run-dir",
        help="where metrics, checkpoints, logs and the Redis data go; an existing run "
        "directory goes on from its newest checkpoint",
    )
    p.add_argument("--workers", type=int, default=1, help="rollout workers (default 1)")
    p.add_argument("--generation-servers", type=int, default=1, help="generation servers (default 1)")
    p.add_argument(
        "--max-restarts", type=int, default=3, help="restarts of each crashed service (Redis included) before giving up"
    )
    p.add_argument(
        "--restart-delay",
        type=float,
        default=0.0,
        help="seconds before a crashed service is restarted, doubled at each further restart of "
        "that service (default 0: at once; Redis is always restarted at once)",
    )
    p.add_argument("--startup-timeout", type=float, default=180.0, help="seconds a service may take to be ready")
    p.add_argument(
        "--tinker",
        action="store_true",
        help="also serve the Tinker API (`rlhf serve tinker`) on tinker.port for as long as the run lasts: "
        "the official tinker SDK trains models of its own there, beside the run (docs/tinker.md)",
    )
    p.add_argument(
        "--tinker-generation",
        action="store_true",
        help="serve the Tinker API as --tinker does, its samples decoded by a generation server of its own "
        "(started with it, outside the run's registry: tinker.generation) instead of in the API's process",
    )
    p.add_argument(
        "--tinker-trainer",
        action="store_true",
        help="serve the Tinker API as --tinker does, its clients' training models held by a trainer of its own "
        "(`rlhf serve tinker-trainer`, started with it: tinker.trainer) instead of in the API's process; "
        "with --tinker-generation, both",
    )
    p.set_defaults(func=cmd_up)


def cmd_up(args) -> int:
    cfg = load_config(args, data=True, sampler=True)
    problem = run_dir_problem(cfg.run.run_dir) or run_dir_conflict(cfg, Mode.DISTRIBUTED)
    if problem:
        return error(problem)
    from ...launcher import run_up

    try:
        return run_up(cfg, args)
    except USER_ERRORS as e:
        return error(e)
