"""`rlhf config validate FILE` (or `-c FILE`: the resolved config, or every error) and `rlhf config describe`
(every key: default, choices, meaning)."""

from __future__ import annotations

import os
import sys

from ...common.config import dump_config
from ..preflight import backend_errors, context_errors, model_findings
from ..shared import add_config_args, error, load_config


def add_parser(sub) -> None:
    p = sub.add_parser("config", help="configuration tools")
    csub = p.add_subparsers(dest="config_command", required=True)
    v = csub.add_parser("validate", help="print the resolved config or every error (exit 2)")
    v.add_argument("file", nargs="?", help="YAML config file (or -c FILE; default $RLHF_CONFIG)")
    add_config_args(v, required=False)
    v.set_defaults(func=cmd_config_validate)
    d = csub.add_parser("describe", help="every config key with its default, choices and meaning")
    d.add_argument("--markdown", action="store_true", help="a markdown table (docs/configuration.md's)")
    d.set_defaults(func=cmd_config_describe)


def cmd_config_validate(args) -> int:
    if args.file and args.config and args.config != os.environ.get("RLHF_CONFIG") and args.file != args.config:
        return error(f"two config files given ({args.file} and -c {args.config}): give one")
    args.config = args.file or args.config
    if not args.config:
        return error("give a config file (rlhf config validate FILE, or -c FILE) or set $RLHF_CONFIG")
    cfg = load_config(
        args, data=True, validate=True
    )  # no sampler check: a config is often checked away from where it runs
    for note in backend_errors(cfg):
        print(f"note: {note} (the generation servers need it where they run)", file=sys.stderr)
    for note in model_findings(cfg)[1] + context_errors(cfg):
        print(f"note: {note}", file=sys.stderr)
    sys.stdout.write(dump_config(cfg))
    return 0


def cmd_config_describe(args) -> int:
    from ..config_docs import describe_config

    sys.stdout.write(describe_config("markdown" if args.markdown else "text"))
    return 0
