"""Hunt flaky tests, in two modes, and report every failure (no test is ever re-run to hide one).

Load (the default): the timing-sensitive tests several times in a row while every core is kept
busy by a background load.

    make flake-hunt                       (3 runs, one busy process per core)
    python tests/flake_hunt.py --runs 5 --load 4 [--tests tests/e2e/test_chaos.py ...] [-- PYTEST ARGS]

Machines: the tests that assert a learning outcome, once under each of other CPUs' float kernels
(`ATEN_CPU_CAPABILITY` default / avx2 / avx512, those this CPU can run) and each thread count
(`OMP_NUM_THREADS` 1 / 2 / 3): a learning assertion that holds only on the machine it was written
on fails here.

    make flake-hunt MODE=machines
    python tests/flake_hunt.py --machines [--capabilities default avx2] [--threads 1 2] [--tests ...]

The load is `--load` processes spinning on the CPU at the tests' own priority. Each run's JUnit
report is kept in runs/flake-hunt/run-N.xml. Exit 0 only when every run passed every test.

Prints, per run, its outcome and time; at the end, each test that ever failed, in how many runs,
with the first line of its first failure:

    run 1/3: 97 passed, 0 failed in 612 s
    ...
    flake hunt: 3 runs x 97 tests under a load of 2 busy processes on 2 cores: no failure
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the tests that wait on processes, threads, clocks and deadlines
TIMING_SENSITIVE = [
    "tests/e2e/test_distributed.py",
    "tests/e2e/test_chaos.py",
    "tests/e2e/test_sync_matches_local.py",
    "tests/common/replay",
    "tests/rollout",
    "tests/reward/test_reward_api_faults.py",
    "tests/reward/test_server.py",
    "tests/generation/test_cancel.py",
    "tests/generation/test_liveness.py",
    "tests/learner/test_liveness.py",
    "tests/learner/test_learner_server.py",
    "tests/learner/test_fsdp.py",
    "tests/weights/test_deadlines.py",
    "tests/common/rpc",
    "tests/test_launcher.py",
]
# the tests that assert a learning outcome (a reward, an eval, an accuracy, an explained variance)
LEARNING = [
    "tests/learner/test_learning_guarantees.py",
    "tests/learner/test_reward_hacking.py",
    "tests/learner/test_critic_diagnostics.py",
    "tests/reward_model/test_train_rm.py",
    "tests/reward_model/test_rlaif_pipeline.py",
    "tests/cli/test_eval.py",
]
CAPABILITIES = ["default", "avx2", "avx512"]
THREADS = [1, 2, 3]
SPIN = "while True: pass"


def start_load(n: int) -> list[subprocess.Popen]:
    return [
        subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.DEVNULL, start_new_session=True)
        for _ in range(n)
    ]


def stop_load(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def outcomes(report: Path) -> tuple[int, dict[str, str]]:
    """(tests run, {test id: first line of its failure or error}) from a JUnit report."""
    if not report.exists():
        return 0, {"<the run>": "no report: pytest did not finish"}
    ran, failed = 0, {}
    for case in ET.parse(report).getroot().iter("testcase"):
        if case.find("skipped") is not None:
            continue
        ran += 1
        for tag in ("failure", "error"):
            bad = case.find(tag)
            if bad is not None:
                name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
                failed[name] = (bad.get("message") or bad.text or tag).strip().splitlines()[0][:200]
    return ran, failed


def pytest_run(tests: list[str], report: Path, extra: list[str], env: dict | None = None) -> tuple[int, dict[str, str]]:
    """One pytest run of `tests` (the vLLM and Docker suites left out); its outcomes."""
    report.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", *tests, "-m", "not vllm and not docker", "-q", "-p", "no:cacheprovider"]
    subprocess.run([*cmd, f"--junitxml={report}", *extra], cwd=ROOT, env=env)
    return outcomes(report)


def capability(name: str) -> str:
    """The kernels torch runs under ATEN_CPU_CAPABILITY=name on this CPU (lower case): a capability
    the CPU lacks falls back to the best it has."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": name}
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.strip().lower()


def summarise(title: str, runs: int, counts: list[int], failures: dict[str, list[tuple[str, str]]]) -> int:
    print(
        f"\nflake hunt: {title} x {max(counts, default=0)} tests: "
        + (f"{len(failures)} failed" if failures else "no failure")
    )
    for name, seen in sorted(failures.items()):
        where = ", ".join(r for r, _ in seen)
        print(f"  {name}: failed in {len(seen)} of {runs} runs ({where}): {seen[0][1]}")
    return 1 if failures else 0


def machines(args, extra: list[str]) -> int:
    """The learning tests under each capability x thread count."""
    out = Path(args.out)
    combos = []
    for cap in args.capabilities:
        got = capability(cap)
        if got != cap:
            print(f"ATEN_CPU_CAPABILITY={cap}: this CPU runs {got or 'nothing'} instead; left out", flush=True)
            continue
        combos += [(cap, n) for n in args.threads]
    print(f"flake hunt (machines): {' '.join(args.tests)} under {len(combos)} kernel x thread settings", flush=True)
    failures: dict[str, list[tuple[str, str]]] = defaultdict(list)
    counts = []
    for cap, n in combos:
        label = f"{cap}/{n} thread{'s' if n > 1 else ''}"
        env = {**os.environ, "ATEN_CPU_CAPABILITY": cap, "OMP_NUM_THREADS": str(n), "MKL_NUM_THREADS": str(n)}
        t0 = time.monotonic()
        ran, failed = pytest_run(args.tests, out / f"machines-{cap}-t{n}.xml", extra, env)
        counts.append(ran)
        for name, first in failed.items():
            failures[name].append((label, first))
        print(f"{label}: {ran - len(failed)} passed, {len(failed)} failed in {time.monotonic() - t0:.0f} s", flush=True)
    return summarise(f"{len(combos)} settings (capability/threads)", len(combos), counts, failures)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="runs in a row (default 3)")
    ap.add_argument(
        "--load", type=int, default=os.cpu_count() or 2, help="busy processes in the background (default: one per core)"
    )
    ap.add_argument("--machines", action="store_true", help="the learning tests under other CPUs' kernels and threads")
    ap.add_argument("--capabilities", nargs="+", default=CAPABILITIES, help="machines: ATEN_CPU_CAPABILITY values")
    ap.add_argument("--threads", nargs="+", type=int, default=THREADS, help="machines: OMP_NUM_THREADS values")
    ap.add_argument("--tests", nargs="+", help="test paths (default: the timing-sensitive, or the learning ones)")
    ap.add_argument("--out", default=str(ROOT / "runs" / "flake-hunt"), help="where the JUnit reports go")
    args = ap.parse_args(argv)
    args.tests = args.tests or (LEARNING if args.machines else TIMING_SENSITIVE)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.machines:
        return machines(args, extra)
    print(
        f"flake hunt: {args.runs} runs of {' '.join(args.tests)} under a load of {args.load} busy processes "
        f"on {os.cpu_count()} cores",
        flush=True,
    )
    failures: dict[str, list[tuple[str, str]]] = defaultdict(list)
    counts = []
    load = start_load(args.load)
    try:
        for run in range(1, args.runs + 1):
            t0 = time.monotonic()
            ran, failed = pytest_run(args.tests, out / f"run-{run}.xml", extra)
            counts.append(ran)
            for name, first in failed.items():
                failures[name].append((f"run {run}", first))
            print(
                f"run {run}/{args.runs}: {ran - len(failed)} passed, {len(failed)} failed in "
                f"{time.monotonic() - t0:.0f} s",
                flush=True,
            )
    finally:
        stop_load(load)
    return summarise(
        f"{args.runs} runs under a load of {args.load} busy processes on {os.cpu_count()} cores",
        args.runs,
        counts,
        failures,
    )


if __name__ == "__main__":
    sys.exit(main())
