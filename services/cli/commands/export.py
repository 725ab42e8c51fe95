"""`rlhf export CHECKPOINT`: a checkpoint (of `rlhf up` or `train --local`) or a LoRA adapter as a
Hugging Face model directory."""

from __future__ import annotations

from pathlib import Path

from ..shared import USER_ERRORS, add_config_args, error, load_config


def add_parser(sub) -> None:
    p = sub.add_parser(
        "export",
        help="a checkpoint (of `rlhf up` or `train --local`) or a LoRA adapter as a Hugging Face model directory",
    )
    p.add_argument("checkpoint", help="checkpoints/iter_N of a run, or an adapter directory")
    add_config_args(p)
    p.add_argument("--out", required=True, help="the directory to write")
    p.set_defaults(func=cmd_export)


def cmd_export(args) -> int:
    cfg = load_config(args)
    from ...generation.policy import export_policy

    try:
        export_policy(args.checkpoint, cfg.model.path, Path(args.out))
    except USER_ERRORS as e:
        return error(e)
    print(f"{args.checkpoint} written to {args.out} as a Hugging Face model directory")
    return 0
