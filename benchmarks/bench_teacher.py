"""Benchmark: the distillation teacher's reading of one iteration's batch, with the prompts shared
across their samples (`distill.share_prompts`, the default) and without (every sequence read whole).

    python benchmarks/bench_teacher.py -c configs/smollm2-cpu.yaml [--prompts 16] [--samples 8]
        [--dtypes float32,bfloat16] [--repeats 3] [--out runs/bench/teacher.json]

The batch is real: the config's first `--prompts` training prompts (rendered and tokenized as the
run renders them), `--samples` answers each sampled by the hf backend at temperature 1 (up to
response_length tokens). The teacher is `model.path` (the distilled recipe's teacher is a model of
the same size). Prints per dtype and setting the median seconds of `Teacher.score` over
`--repeats` (after one warm-up), the largest difference between the two settings' log-probs, and
the peak resident memory the process reached.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _batch(cfg, n_prompts: int, samples: int) -> tuple[list[list[int]], list[list[int]]]:
    from services.common.types import SamplingParams
    from services.generation.policy import make_backend
    from services.training.data import config_prompts

    backend = make_backend(cfg)
    records = config_prompts(cfg, "train", backend.tokenizer)[:n_prompts]
    ids = [backend.tokenizer.encode(r.prompt, add_special_tokens=False) for r in records]
    out = backend.generate(ids, SamplingParams(n=samples, temperature=1.0, max_new_tokens=cfg.response_length, seed=0))
    prompts = [p for p, cs in zip(ids, out.completions) for _ in cs]
    responses = [list(c.token_ids) for cs in out.completions for c in cs]
    return prompts, responses


def _time(teacher, prompts, responses, repeats: int) -> tuple[float, list[list[float]]]:
    got = teacher.score(prompts, responses)  # warm-up
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        got = teacher.score(prompts, responses)
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds), got.log_probs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-c", "--config", default="configs/smollm2-cpu.yaml")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="runs/bench/teacher.json")
    args = ap.parse_args()

    from services.common.config import load_config
    from services.teacher.teacher import Teacher

    cfg = load_config(args.config)
    prompts, responses = _batch(cfg, args.prompts, args.samples)
    tokens = sum(len(p) + len(r) for p, r in zip(prompts, responses))
    print(
        f"batch: {args.prompts} prompts x {args.samples} samples = {len(prompts)} sequences, "
        f"{tokens} tokens ({statistics.mean(len(p) for p in prompts):.0f} prompt, "
        f"{statistics.mean(len(r) for r in responses):.1f} response on average)"
    )
    rows = []
    for dtype in args.dtypes.split(","):
        results = {}
        for share in (False, True):
            teacher = Teacher(cfg.model.path, cfg.model.device, dtype, cfg.distill.micro_batch_size, share)
            results[share] = _time(teacher, prompts, responses, args.repeats)
            del teacher
        diff = max(abs(a - b) for x, y in zip(results[False][1], results[True][1]) for a, b in zip(x, y))
        row = {
            "dtype": dtype,
            "whole_s": round(results[False][0], 3),
            "shared_s": round(results[True][0], 3),
            "speedup": round(results[False][0] / results[True][0], 2),
            "max_abs_diff": diff,
        }
        rows.append(row)
        print(
            f"{dtype:9s} every sequence whole {row['whole_s']:6.2f} s   prompts shared {row['shared_s']:6.2f} s   "
            f"{row['speedup']:.2f}x   largest log-prob difference {diff:.1e}"
        )
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak resident memory {peak_gb:.2f} GB")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"sequences": len(prompts), "tokens": tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
