"""Benchmark: whole iterations of a real config, in-process and under `rlhf up`: seconds per
iteration split into generate (or wait for the rollout) / train / push, generated tokens/s,
samples/s, and the peak resident memory (the largest single process: under `rlhf up` every
service is its own process).

    python benchmarks/bench_iteration.py -c configs/smollm2-cpu.yaml --iterations 4 [--set model.bf16=true]
    python benchmarks/bench_iteration.py ... --modes local     (only `rlhf train --local`)

Each mode runs one after the other (never side by side: they would share the cores), in its own
run directory under --out-dir, from the config's base model; iteration 1 is left out of the
medians (warm-up). Held-out numbers: run the config for its real length and `rlhf eval`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_runs import rows, samples_per_iteration, time_split, training_seconds  # noqa: E402

RLHF = [sys.executable, "-m", "services.cli"]


def run_mode(mode: str, config: str, run_dir: Path, iterations: int, overrides: list[str]) -> dict:
    cmd = (
        RLHF
        + (["train", "--local"] if mode == "local" else ["up"])
        + [
            "-c",
            config,
            "--run-dir",
            str(run_dir),
            "--set",
            f"run.iterations={iterations}",
            "--set",
            f"run.eval_interval={iterations}",
            "--set",
            f"run.checkpoint_interval={iterations}",
        ]
    )
    for o in overrides:
        cmd += ["--set", o]
    t0 = time.perf_counter()
    log = open(run_dir.with_suffix(".log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}); see {log.name}")
    steps = [r for r in rows(run_dir) if r["iteration"] > 1 and "time/iteration_s" in r]
    per_it = statistics.median(training_seconds(r) for r in steps)  # without the held-out eval
    n = samples_per_iteration(run_dir)
    return {
        "mode": mode,
        "wall_s": time.perf_counter() - t0,
        "s_per_iteration": per_it,
        "samples_per_s": n / per_it,
        "split": time_split(steps),
        "iterations_measured": len(steps),
        # wait4's peak: the command's process or any process it waited for (the services), the largest
        "peak_rss_mb": usage.ru_maxrss / 1024,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--config", default="configs/smollm2-cpu.yaml")
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--modes", default="local,up")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out-dir", default="runs/bench/iteration")
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for mode in args.modes.split(","):
        run_dir = out / mode
        print(
            f"[{time.strftime('%H:%M:%S')}] {mode}: {args.iterations} iterations of {args.config} "
            f"{' '.join(args.overrides)} (log {run_dir.with_suffix('.log')})",
            flush=True,
        )
        results.append(run_mode(mode, args.config, run_dir, args.iterations, args.overrides))
    print(
        f"{'mode':<7}{'s/it':>7}{'samples/s':>11}{'generate':>10}{'wait':>7}{'train':>8}{'push':>7}"
        f"{'tok/s':>7}{'peak MB':>9}"
    )
    for r in results:
        s = r["split"]
        print(
            f"{r['mode']:<7}{r['s_per_iteration']:>7.1f}{r['samples_per_s']:>11.2f}"
            + "".join(
                f"{s[k]:>{w}.1f}" if k in s else f"{'-':>{w}}"
                for k, w in (("generate", 10), ("wait", 7), ("train", 8), ("push", 7))
            )
            + f"{s.get('tokens/s', 0):>7.0f}{r['peak_rss_mb']:>9.0f}"
        )
    (out / "summary.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
