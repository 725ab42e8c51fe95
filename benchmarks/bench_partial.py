"""Benchmark: what partial rollouts (`rollout.partial_tokens`) cost on the `hf` backend, in process.

    python benchmarks/bench_partial.py -c configs/smollm2-cpu.yaml [--partial 8,32] [--tokens 128]
        [--prompts 8] [--repeats 3] [--out runs/bench/partial.json]

One greedy batch (`--prompts` open-ended instructions through the model's chat template, or the
config's own prompts with `--config-prompts`; n=1, `--tokens` new tokens at most) decoded whole and
then paused every P tokens for each P of `--partial` (services/training/partial.py over the backend),
each round of the benchmark running every way in turn (noise hits all alike), medians over the
rounds. Prints per way the batch's seconds, its cost over the whole batch (each continuation
prefills prompt + tokens so far again), the longest single call (what a weight push waits for at
most between two calls), the rounds, and whether the tokens are those of the whole batch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

TOPICS = ["the water cycle", "a bicycle", "the stock market", "photosynthesis", "a compiler", "volcanoes"]


def _prompts(cfg, tok, count: int, from_config: bool) -> list[list[int]]:
    if from_config:
        from services.training.data import config_prompts

        records = config_prompts(cfg, "train", tok)[:count]
        return [tok(r.prompt, add_special_tokens=False)["input_ids"] for r in records]
    texts = [f"Explain in detail how {TOPICS[i % len(TOPICS)]} works, step by step." for i in range(count)]
    if getattr(tok, "chat_template", None):
        texts = [
            tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
            for t in texts
        ]
        return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    return [tok(t)["input_ids"] for t in texts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--config", default="configs/smollm2-cpu.yaml")
    ap.add_argument("--partial", default="8,32", help="the chunk sizes to pause at, comma-separated")
    ap.add_argument("--tokens", type=int, default=128, help="max_new_tokens")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--config-prompts", action="store_true", help="the config's training prompts instead")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    from services.common.config import load_config
    from services.common.types import SamplingParams
    from services.generation.backend import HFBackend
    from services.training.partial import PartialRollouts

    cfg = load_config(args.config)
    backend = HFBackend(cfg.model.path, "cpu")
    prompts = _prompts(cfg, backend.tokenizer, args.prompts, args.config_prompts)
    params = SamplingParams(n=1, temperature=0, max_new_tokens=args.tokens)
    calls: list[float] = []

    def timed(prompts, params, _first, _part):
        t0 = time.perf_counter()
        out = backend.generate(prompts, params)
        calls.append(time.perf_counter() - t0)
        return out

    ways = {"whole": None, **{f"paused every {p}": int(p) for p in args.partial.split(",")}}
    rows: dict[str, list[dict]] = {w: [] for w in ways}
    whole_tokens = None
    for _ in range(args.repeats):
        for way, p in ways.items():
            calls.clear()
            partial = PartialRollouts(timed, p) if p else PartialRollouts(timed, args.tokens)
            t0 = time.perf_counter()
            out = partial.generate(prompts, params)
            secs = time.perf_counter() - t0
            tokens = [c.token_ids for cs in out.completions for c in cs]
            whole_tokens = whole_tokens if p else tokens
            rows[way].append(
                {
                    "s": secs,
                    "longest_call_s": max(calls),
                    "rounds": len(calls),
                    "tokens": out.tokens,
                    "same_tokens": tokens == whole_tokens,
                }
            )
    base = statistics.median(r["s"] for r in rows["whole"])
    report = {}
    for way, rs in rows.items():
        s = statistics.median(r["s"] for r in rs)
        report[way] = {
            "s": round(s, 3),
            "cost": f"{100 * (s / base - 1):+.1f}%",
            "longest_call_s": round(statistics.median(r["longest_call_s"] for r in rs), 3),
            "rounds": rs[-1]["rounds"],
            "tokens": rs[-1]["tokens"],
            "same_tokens": all(r["same_tokens"] for r in rs),
        }
        print(way, json.dumps(report[way]))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"config": args.config, "args": vars(args), "ways": report}, indent=1))


if __name__ == "__main__":
    main()
