"""The held-out curves of runs side by side, from their metrics.jsonl: per evaluation the
samples trained on so far, minutes, the held-out reward (the gold judge when reward.eval_rules
is set), the proxy's held-out reward (`eval/proxy_reward_mean`), the KL to the reference and the
critic's explained variance; then seconds per iteration and per sample, and where an iteration's
time goes (medians: generating, or waiting for the rollout under `rlhf up`; training; the push),
with generated tokens/s. A benchmark: it measures and prints.

    python benchmarks/compare_runs.py runs/smollm2-rlhf/ppo runs/smollm2-rlhf/grpo [--key eval/math_answer]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import yaml


def rows(run_dir: Path) -> list[dict]:
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a run still writing its last line
            break
    return out


def _f(v, fmt: str = "{:.3f}") -> str:
    return "-" if v is None else fmt.format(v)


def samples_per_iteration(run_dir: Path) -> int:
    """rollout_batch_size x num_return_sequences_in_group, from the run's resolved config.yaml."""
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    return int(cfg["rollout_batch_size"]) * int(cfg["num_return_sequences_in_group"])


def table(name: str, run: list[dict], key: str, per_iteration: int) -> list[str]:
    lines = [
        f"## {name}",
        "| iteration | samples | minutes | held-out | proxy | kl_ref | explained var |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in run:
        samples = r["iteration"] * per_iteration
        if key in r:
            lines.append(
                f"| {r['iteration']} | {samples} | {r.get('wall_s', 0) / 60:.1f} | {_f(r.get(key))} | "
                f"{_f(r.get('eval/proxy_reward_mean'))} | {_f(r.get('ppo/kl_ref'), '{:.4f}')} | "
                f"{_f(r.get('critic/explained_variance'), '{:.2f}')} |"
            )
    steps = [r for r in run if r["iteration"] > 0 and "time/iteration_s" in r]
    if steps:
        per_it = statistics.median(training_seconds(r) for r in steps)
        lines.append(
            f"\nmedian {per_it:.1f} s per iteration, {per_it / per_iteration:.3f} s per sample "
            f"({len(steps)} iterations of {per_iteration} samples)"
        )
        split = time_split(steps)
        lines.append(
            "  "
            + ", ".join(f"{k} {v:.2f} s" for k, v in split.items() if k != "tokens/s")
            + f"; {split.get('tokens/s', 0):.0f} generated tokens/s"
        )
    return lines


def training_seconds(r: dict) -> float:
    """An iteration's seconds without its held-out eval: the learner service counts the eval in
    `time/iteration_s` (and reports it as `time/eval_s`), the in-process trainer does not."""
    return r["time/iteration_s"] - r.get("time/eval_s", 0.0)


def time_split(steps: list[dict]) -> dict[str, float]:
    """Medians over the iterations: generate (in-process) or wait (for the rollout, `rlhf up`),
    train, push, and the rollout's tokens/s."""
    keys = {
        "generate": "time/generate_s",
        "wait": "time/wait_s",
        "train": "time/train_s",
        "push": "time/push_s",
        "tokens/s": "rollout/tokens_per_s",
    }
    return {name: statistics.median(r[k] for r in steps) for name, k in keys.items() if all(k in r for r in steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (each with metrics.jsonl)")
    ap.add_argument("--key", default="eval/reward_mean", help="the held-out metric to show (default %(default)s)")
    args = ap.parse_args()
    for d in args.runs:
        print("\n".join(table(str(d), rows(d), args.key, samples_per_iteration(d))) + "\n")


if __name__ == "__main__":
    main()
