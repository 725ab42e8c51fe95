"""Benchmark: the tiny default under Docker Compose (CPU variant) against `rlhf up`, same config,
same number of rollout workers, interleaved rounds; and the image build with a warm cache.

    make bench-compose      (needs what `make test-docker` sets up; writes runs/bench/compose.json)

Per run: seconds from the command to the first trained iteration, the learner's wall time for the
iterations (summary.json's wall_s), and seconds from the command to the learner's end. For the
image: `docker build` of rlhf:cpu with every layer cached, and after a change of the code (only
the last layer rebuilt), plus the image's size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.compose.support import CPU_FILES, IMAGE, Project, docker  # noqa: E402
from tests.e2e.support import up_command  # noqa: E402


def _overrides(iterations: int) -> list[str]:
    return [f"run.iterations={iterations}", "run.eval_interval=0", "run.checkpoint_interval=0"]


def run_up(model: str, iterations: int, workers: int, work: Path) -> dict:
    run_dir = work / "up"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = up_command("configs/tiny-cpu.yaml", run_dir, "--workers", str(workers), "--set", f"model.path={model}")
    for o in _overrides(iterations):
        cmd += ["--set", o]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = None
    for line in proc.stdout:
        if first is None and line.lstrip().startswith("iter") and not line.split()[1].startswith("0/"):
            first = time.time() - t0
    code = proc.wait()
    if code != 0:
        raise SystemExit(f"rlhf up failed ({code})")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "first_iteration_s": round(first, 1),
        "learner_wall_s": summary["wall_s"],
        "total_s": round(time.time() - t0, 1),
        "final_eval": summary["final_eval_reward"],
    }


def run_compose(iterations: int, workers: int, work: Path, rnd: int) -> dict:
    d = work / f"compose{rnd}"
    d.mkdir(parents=True, exist_ok=True)
    project = Project(
        f"rlhfbench{os.getpid()}x{rnd}", d, CPU_FILES, {"RLHF_OVERRIDES": " ".join(_overrides(iterations))}
    )
    try:
        t0 = time.time()
        project.up("--scale", f"rollout={workers}")
        project.wait_for(lambda: project.iteration() >= 1, 600, "the first iteration")
        first = time.time() - t0
        code = project.wait_learner_done(1200)
        total = time.time() - t0
        if code != 0:
            raise SystemExit(f"compose learner exited {code}:\n{project.logs('learner')[-3000:]}")
        summary = json.loads(project.read("/runs/run/summary.json"))
        return {
            "first_iteration_s": round(first, 1),
            "learner_wall_s": summary["wall_s"],
            "total_s": round(total, 1),
            "final_eval": summary["final_eval_reward"],
        }
    finally:
        project.close()


def bench_build() -> dict:
    """docker build of the CPU image: fully cached, then after a change of the code."""

    def build(context: Path) -> float:
        t0 = time.time()
        subprocess.run(
            [
                "docker",
                "build",
                "-q",
                "-t",
                IMAGE,
                "--build-arg",
                "FLAVOUR=cpu",
                "--build-arg",
                f"BASE_IMAGE={os.environ.get('BASE_IMAGE', 'rlhf-base:bookworm')}",
                str(context),
            ],
            check=True,
            capture_output=True,
        )
        return round(time.time() - t0, 1)

    cached = build(ROOT)
    with tempfile.TemporaryDirectory() as tmp:
        ctx = Path(tmp) / "ctx"
        shutil.copytree(ROOT, ctx, ignore=shutil.ignore_patterns(".git", ".venv*", "runs", "__pycache__"))
        with (ctx / "services" / "__init__.py").open("a") as f:
            f.write("\n# changed for bench_compose\n")
        code_change = build(ctx)
    build(ROOT)  # the image again as the checkout has it
    size = int(docker("image", "inspect", "-f", "{{.Size}}", IMAGE).stdout)
    return {"cached_s": cached, "after_code_change_s": code_change, "image_gb": round(size / 1e9, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="runs/tiny-model")
    ap.add_argument("--iterations", type=int, default=60)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="runs/bench/compose.json")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    work = ROOT / "runs" / "bench" / "compose-work"
    result: dict = {"iterations": args.iterations, "workers": args.workers, "build": bench_build(), "rounds": []}
    for rnd in range(args.rounds):
        this = {
            "rlhf_up": run_up(args.model, args.iterations, args.workers, work),
            "compose": run_compose(args.iterations, args.workers, work, rnd),
        }
        print(f"round {rnd + 1}: {json.dumps(this)}", flush=True)
        result["rounds"].append(this)
    for mode in ("rlhf_up", "compose"):
        result[mode] = {
            k: statistics.median(r[mode][k] for r in result["rounds"])
            for k in ("first_iteration_s", "learner_wall_s", "total_s")
        }
    result["compose_vs_up_learner_wall"] = round(
        result["compose"]["learner_wall_s"] / result["rlhf_up"]["learner_wall_s"], 2
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\n{'':22s}{'first iter s':>14s}{'learner wall s':>16s}{'total s':>10s}")
    for mode in ("rlhf_up", "compose"):
        m = result[mode]
        print(f"{mode:22s}{m['first_iteration_s']:14.1f}{m['learner_wall_s']:16.1f}{m['total_s']:10.1f}")
    b = result["build"]
    print(
        f"image {IMAGE}: {b['image_gb']} GB; build cached {b['cached_s']} s, after a code change "
        f"{b['after_code_change_s']} s; compose/up learner wall {result['compose_vs_up_learner_wall']}x"
    )


if __name__ == "__main__":
    main()
