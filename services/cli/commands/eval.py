"""`rlhf eval`: what a model (any model directory) says on held-out prompts, scored, and compared
with a baseline's (services/cli/eval_model.py)."""

from __future__ import annotations

from ...training.data import source_problem
from ..shared import USER_ERRORS, add_config_args, error, load_config


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="generate on held-out prompts with any model directory, score, compare")
    add_config_args(p)
    p.add_argument(
        "--model",
        help="the model: a directory (base, final/, best/, a checkpoint, a LoRA adapter), the Tinker API's "
        "sampler weights (tinker://RUN/sampler_weights/NAME under tinker.root) or a hub id (default model.path)",
    )
    p.add_argument("--baseline", help="another model scored on the same prompts, side by side")
    p.add_argument(
        "--data",
        dest="eval_data",
        help="the prompts (data.eval): a file, hf:DATASET, synthetic:TASK or reasoning-gym:TASK[?OPTIONS]",
    )
    p.add_argument("--limit", dest="eval_limit", type=int, help="the first N prompts (data.eval_size)")
    p.add_argument("--n", type=int, default=1, help="samples per prompt (mean@n; pass@n with --pass-reward)")
    p.add_argument("--temperature", type=float, help="sampling temperature (default generation.eval_temperature)")
    p.add_argument("--rule", help="score with this rule (e.g. exact_match) instead of the config's reward")
    p.add_argument("--pass-reward", type=float, help="a sample passes at this reward or more (pass@n)")
    p.add_argument("--run-dir", help="the run whose eval/ the rows and summary.json go in (run.run_dir)")
    p.add_argument("--out", help="where the rows and summary.json go (default RUN_DIR/eval)")
    p.set_defaults(func=cmd_eval)


def cmd_eval(args) -> int:
    cfg = load_config(args)
    key, source = ("data.eval", cfg.data.eval) if cfg.data.eval is not None else ("data.train", cfg.data.train)
    problem = source_problem(source)
    if problem:
        return error(f"{key}: {problem}")
    from ..eval_model import main_eval

    try:
        return main_eval(cfg, args)
    except USER_ERRORS as e:
        return error(e)
