"""Hunt flaky tests: run the timing-sensitive tests several times in a row while every core is kept
busy by a background load, and report every failure (no test is ever re-run to hide one).

    make flake-hunt                       (3 runs, one busy process per core)
    python tests/flake_hunt.py --runs 5 --load 4 [--tests tests/e2e/test_chaos.py ...] [-- PYTEST ARGS]

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
    ap.add_argument("--tests", nargs="+", default=TIMING_SENSITIVE, help="test paths (default: the timing-sensitive)")
    ap.add_argument("--out", default=str(ROOT / "runs" / "flake-hunt"), help="where the JUnit reports go")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"flake hunt: {args.runs} runs of {' '.join(args.tests)} under a load of {args.load} busy processes "
        f"on {os.cpu_count()} cores",
        flush=True,
    )
    failures: dict[str, list[tuple[int, str]]] = defaultdict(list)
    counts = []
    load = start_load(args.load)
    try:
        for run in range(1, args.runs + 1):
            report = out / f"run-{run}.xml"
            report.unlink(missing_ok=True)
            t0 = time.monotonic()
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    *args.tests,
                    "-m",
                    "not vllm and not docker",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    f"--junitxml={report}",
                    *extra,
                ],
                cwd=ROOT,
            )
            ran, failed = outcomes(report)
            counts.append(ran)
            for name, first in failed.items():
                failures[name].append((run, first))
            print(
                f"run {run}/{args.runs}: {ran - len(failed)} passed, {len(failed)} failed in "
                f"{time.monotonic() - t0:.0f} s",
                flush=True,
            )
    finally:
        stop_load(load)
    print(
        f"\nflake hunt: {args.runs} runs x {max(counts, default=0)} tests under a load of {args.load} busy "
        f"processes on {os.cpu_count()} cores: " + ("no failure" if not failures else f"{len(failures)} failed")
    )
    for name, seen in sorted(failures.items()):
        print(
            f"  {name}: failed in {len(seen)} of {args.runs} runs (runs {', '.join(str(r) for r, _ in seen)}): "
            f"{seen[0][1]}"
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
