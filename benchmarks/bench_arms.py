"""Benchmark: arms of one recipe side by side, in process (`rlhf train --local`), each arm the
config with its own `--set` overrides, the same seed: held-out accuracy at each eval, by iteration
and by minute, samples per second, and what the arm's own metrics say (dynamic sampling's share of
groups whose rewards were all equal, the sampler/learner drift). For issue 55's two tables: GRPO with
and without DAPO's dynamic sampling in the same wall-clock budget; the bf16 sampler with and
without a rollout correction against the fp32 sampler at the same iterations. For issue 57's:
on-policy distillation and self-distillation against GRPO from the same start (the teacher's cost:
time/teacher_s, and each arm's peak resident memory).

Each arm runs in `--out DIR/<arm>`; an arm whose run finished (summary.json) is read, not run
again, so a long comparison resumes where it stopped.

    python benchmarks/bench_arms.py -c configs/smollm2-cpu.yaml --out runs/bench/dapo \\
        --set run.max_wall_s=900 --set run.iterations=200 \\
        --arm grpo= --arm dapo=rollout.dynamic_sampling=true
    python benchmarks/bench_arms.py -c configs/smollm2-cpu.yaml --out runs/bench/bf16 --set run.iterations=20 \\
        --arm fp32= --arm bf16=generation.dtype=bfloat16 \\
        --arm bf16+seq_mask=generation.dtype=bfloat16,rollout_correction=seq_mask
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHOWN = ("rollout/equal_groups_frac", "rollout/dynamic_rounds", "rollout_correction/kl", "rollout_correction/ess_seq",
         "rollout_correction/masked_seq_frac", "rollout_correction/masked_token_frac", "time/teacher_s",
         "distill/reverse_kl", "distill/teacher_top1_agree")  # fmt: skip


def run_arm(config: str, common: list[str], overrides: list[str], run_dir: Path) -> None:
    """The arm's `train --local` run, unless it finished already."""
    if (run_dir / "summary.json").exists():
        print(f"{run_dir.name}: finished before, read", flush=True)
        return
    sets = [x for kv in common + overrides for x in ("--set", kv)]
    cmd = [sys.executable, "-m", "services.cli", "train", "--local", "-c", config, "--run-dir", str(run_dir), *sets]
    print(f"{run_dir.name}: {' '.join(cmd[2:])}", flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    (run_dir / "peak_rss.json").write_text(json.dumps({"peak_rss_mb": usage.ru_maxrss / 1024}))


def read_arm(run_dir: Path) -> dict:
    """The arm's evals (iteration, minutes, accuracy), samples/s, and the mean of the SHOWN metrics."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    wall, evals, samples, seconds = 0.0, [], 0, 0.0
    for r in rows:
        if "time/iteration_s" in r:
            wall += r["time/iteration_s"]
            samples += r.get("rollout/samples", 0)
            seconds += r.get("time/rollout_s", r.get("time/generate_s", 0.0))
        if "eval/reward_mean" in r:
            evals.append((r["iteration"], wall / 60, r["eval/reward_mean"]))
    trained = [r for r in rows if "time/iteration_s" in r]
    rss = run_dir / "peak_rss.json"
    shown = {k: sum(r[k] for r in trained if k in r) / max(sum(k in r for r in trained), 1) for k in SHOWN}
    return {
        "evals": evals,
        "iterations": len(trained),
        "minutes": wall / 60,
        "samples_per_s": samples / seconds if seconds else float("nan"),
        **{k: v for k, v in shown.items() if any(k in r for r in trained)},
        **(json.loads(rss.read_text()) if rss.exists() else {}),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-c", "--config", required=True)
    ap.add_argument("--out", required=True, help="a directory: one run per arm under it")
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE for every arm")
    ap.add_argument("--arm", action="append", required=True, help="NAME=KEY=VALUE[,KEY=VALUE...] (NAME= : the config)")
    args = ap.parse_args()
    out = Path(args.out)
    results = {}
    for arm in args.arm:
        name, _, sets = arm.partition("=")
        run_arm(args.config, args.set, [s for s in sets.split(",") if s], out / name)
        results[name] = read_arm(out / name)
        (out / "arms.json").write_text(json.dumps(results, indent=1))
    for name, r in results.items():
        extra = "".join(f", {k} {v:.3f}" for k, v in r.items() if k in SHOWN)
        rate = f"{r['samples_per_s']:.1f} trained samples per second of sampling"
        if "peak_rss_mb" in r:
            rate += f", peak RSS {r['peak_rss_mb']:.0f} MB"
        print(f"\n{name}: {r['iterations']} iterations in {r['minutes']:.1f} min, {rate}{extra}")
        print("  iteration  minute  held-out")
        for it, minute, acc in r["evals"]:
            print(f"  {it:9d}  {minute:6.1f}  {acc:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
