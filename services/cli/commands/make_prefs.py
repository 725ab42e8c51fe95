"""`rlhf make-prefs`: preference pairs labelled by a judge (RLAIF), for `rlhf train-rm`."""

from __future__ import annotations

from pathlib import Path

from ..shared import USER_ERRORS, add_config_args, error, load_config


def add_parser(sub) -> None:
    p = sub.add_parser(
        "make-prefs",
        help="preference pairs labelled by a judge (RLAIF): every pair of the policy's "
        "samples on a training prompt that the judge tells apart",
    )
    add_config_args(p)
    p.add_argument("--out", required=True, help="the jsonl file of pairs to write")
    p.add_argument("--n", type=int, default=4, help="samples per prompt (default 4)")
    p.add_argument("--temperature", type=float, help="sampling temperature (default generation.temperature)")
    p.add_argument("--limit", type=int, help="the first N training prompts")
    p.add_argument("--min-gap", type=float, default=1e-9, help="least judge-score gap between chosen and rejected")
    p.add_argument(
        "--more", type=int, default=0, help="further samples for each prompt whose samples the judge told apart"
    )
    p.add_argument(
        "--hard-negatives",
        type=int,
        default=0,
        help="counterfactuals (a number changed) of each best answer of a prompt, judged: hard pairs",
    )
    p.add_argument("--max-pairs-per-prompt", type=int, help="at most this many pairs of a prompt (default: all)")
    p.set_defaults(func=cmd_make_prefs)


def cmd_make_prefs(args) -> int:
    cfg = load_config(args, data=True, sampler=True, judge=True)  # the reward model may be what its pairs will train
    from ...reward_model.rlaif import PairPlan, make_preferences

    plan = PairPlan(
        n=args.n,
        temperature=args.temperature,
        limit=args.limit,
        min_gap=args.min_gap,
        more=args.more,
        hard_negatives=args.hard_negatives,
        max_pairs_per_prompt=args.max_pairs_per_prompt,
    )
    try:
        make_preferences(cfg, Path(args.out), plan, say=lambda line: print(line, flush=True))
    except USER_ERRORS as e:
        return error(e)
    return 0
