"""`rlhf train --local`: the whole PPO loop in one process, until it ends or Ctrl-C/SIGTERM stops it
at the end of an iteration, checkpointed."""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import sys
import threading
from typing import TYPE_CHECKING

from ...common.checkpoints import Mode
from ..rundir import run_dir_conflict
from ..shared import EXIT_CONFIG, RESUME_HELP, USER_ERRORS, add_config_args, error, load_config, run_dir_problem

if TYPE_CHECKING:
    from ...common.config import Config


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train", help="train with PPO", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=RESUME_HELP
    )
    add_config_args(p)
    p.add_argument("--local", action="store_true", help="run every part in this process")
    p.add_argument(
        "--run-dir",
        help="where metrics, summary, curves and checkpoints go; an existing run directory "
        "goes on from its newest checkpoint",
    )
    p.set_defaults(func=cmd_train)


def cmd_train(args) -> int:
    cfg = load_config(args, data=True, sampler=True)
    if not args.local:
        print("distributed training is `rlhf up`; use `rlhf train --local` for the in-process trainer", file=sys.stderr)
        return EXIT_CONFIG
    problem = run_dir_problem(cfg.run.run_dir) or run_dir_conflict(cfg, Mode.LOCAL)
    if problem:
        return error(problem)
    return _run(cfg, args)


def _run(cfg: Config, args) -> int:
    """run_local until the run ends (0), or a signal stops it (128 + the signal)."""
    from ...local import run_local

    stop = StopSignal()
    try:
        with stop.installed():
            summary = run_local(cfg, cfg.run.run_dir, stop_event=stop.event)
    except USER_ERRORS as e:
        return error(e)
    except KeyboardInterrupt:  # the second Ctrl-C
        print("interrupted again: stopped at once, without a checkpoint of this iteration", file=sys.stderr)
        return 128 + signal.SIGINT
    if "stopped_at" not in summary:
        return 0
    if "lost" in summary:  # the environment, the reward or the agent lost mid-run: checkpointed, as a stop is
        print(f"error: the run stopped: {summary['lost']}; {_go_on(summary, cfg, args)}", file=sys.stderr)
        return 1
    print(_interrupted(summary, cfg, args), file=sys.stderr)
    return 128 + stop.signum


class StopSignal:
    """Ctrl-C (SIGINT) or SIGTERM asks a run to stop at the end of its iteration, checkpointed
    (`event` is set); a second Ctrl-C stops it at once (KeyboardInterrupt)."""

    def __init__(self):
        self.event, self.signum = threading.Event(), 0

    def _on_signal(self, signum, frame) -> None:
        self.signum = signum
        self.event.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # os.write, not print: the run may be inside a print to stderr when the signal comes
        os.write(2, b"stopping at the end of this iteration, with a checkpoint (Ctrl-C again: at once, without)\n")

    @contextlib.contextmanager
    def installed(self):
        before = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)


def _go_on(summary: dict, cfg: Config, args) -> str:
    """Where a stopped run's checkpoint is and the command that goes on from it."""
    again = shlex.join(["rlhf", *args.argv])
    if summary["checkpoint"] is None:
        return f"no iteration was done; start again with {again}"
    if cfg.run.resume_from:
        again += f" --set run.resume_from={summary['checkpoint']}"
    return (
        f"checkpoint of iteration {summary['stopped_at']} in {summary['checkpoint']}; once mended, resume with {again}"
    )


def _interrupted(summary: dict, cfg: Config, args) -> str:
    """The line a stopped `train --local` ends with: where it stopped, its checkpoint, how to go on."""
    again = shlex.join(["rlhf", *args.argv])
    if summary["checkpoint"] is None:
        return (
            f"interrupted before iteration {summary['stopped_at'] + 1}: nothing to keep yet; start again with {again}"
        )
    if cfg.run.resume_from:  # the same command would go on from run.resume_from again
        again += f" --set run.resume_from={summary['checkpoint']}"
    return (
        f"interrupted at iteration {summary['stopped_at']}: checkpoint in {summary['checkpoint']}; resume with {again}"
    )
