"""The spread of the tiny default's held-out gain over seeds and other CPUs' float kernels: what a
bound on "it learns" may assert.

The end-to-end tests of `rlhf up` (tests/e2e/test_vllm_run.py, test_sharded_learner.py,
tests/compose/test_compose_run.py) assert that 60 iterations of the tiny default raise the
held-out reward by at least 0.25. A run is a chaotic trajectory: each seed, and each
`ATEN_CPU_CAPABILITY` / thread count (another CPU), ends elsewhere. This runs the same 60
iterations in process (`train --local`: the same algorithm) for every seed x capability x threads
asked, each on a tiny model built under those kernels, and prints each gain, their mean, spread
and minimum, and the bound mean - 4 sd that the tests' 0.25 is held against.

    python benchmarks/bench_learning_spread.py [--seeds 0 1 2 3] [--capabilities default avx2 avx512]
                                               [--threads 1 2] [--iterations 60] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ONE = """
import json, sys
from pathlib import Path
from services.cli.tiny import init_tiny_model
from services.common.config import load_config
from services.local import run_local
seed, iterations, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
model = init_tiny_model(out / "model", warm_start_steps=100, seed=0)
cfg = load_config("configs/tiny-cpu.yaml", [f"model.path={model}", f"run.iterations={iterations}",
                  f"run.eval_interval={iterations // 2}", "run.checkpoint_interval=0", f"run.seed={seed}",
                  "run.tensorboard=false"])
s = run_local(cfg, out / "run")
print(json.dumps({"gain": s["final_eval_reward"] - s["baseline_eval_reward"], "baseline": s["baseline_eval_reward"]}))
"""


def capability(name: str) -> str:
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": name}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.strip().lower()


def one_run(seed: int, cap: str, threads: int, iterations: int) -> dict:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": cap, "OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE"}
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(
            [sys.executable, "-c", ONE, str(seed), str(iterations), tmp],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3])
    ap.add_argument("--capabilities", nargs="+", default=["default", "avx2", "avx512"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--iterations", type=int, default=60)
    ap.add_argument("--out", help="write every run's numbers here (JSON)")
    args = ap.parse_args()
    caps = [c for c in args.capabilities if capability(c) == c]
    rows = []
    for cap in caps:
        for threads in args.threads:
            for seed in args.seeds:
                t0 = time.monotonic()
                r = one_run(seed, cap, threads, args.iterations)
                rows.append({"capability": cap, "threads": threads, "seed": seed, **r})
                print(
                    f"{cap:>8} {threads} thread(s) seed {seed}: baseline {r['baseline']:.3f}, "
                    f"gain {r['gain']:+.3f} ({time.monotonic() - t0:.0f} s)",
                    flush=True,
                )
    gains = [r["gain"] for r in rows]
    mean, sd = statistics.mean(gains), statistics.stdev(gains) if len(gains) > 1 else 0.0
    print(
        f"\n{len(gains)} runs of {args.iterations} iterations ({', '.join(caps)}; threads "
        f"{', '.join(map(str, args.threads))}; seeds {', '.join(map(str, args.seeds))}): held-out gain "
        f"mean {mean:+.3f}, sd {sd:.3f}, min {min(gains):+.3f}, max {max(gains):+.3f}; "
        f"mean - 4 sd = {mean - 4 * sd:+.3f} (the tests assert >= +0.25)"
    )
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": rows, "mean": mean, "sd": sd}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
