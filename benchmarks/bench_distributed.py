"""Benchmark: the distributed loop against the in-process trainer, on the same config, in one run.

    make bench           (writes runs/bench/distributed.json and prints a table)

1. `rlhf train --local`                       the whole loop in one process
2. `rlhf up`  (max_staleness=0, synchronous)  every service its own process, Redis in between
3. `rlhf up`  (max_staleness=1, asynchronous) generation overlaps training
Per mode: median seconds per iteration after a warm-up, the steady-state wall time per iteration
(from metrics.jsonl timestamps), weight-push seconds and MB/s, generation tokens/s, held-out reward.
Then the replay buffer alone on an embedded Redis: put (claim + produce) and get (read + commit)
records per second with records the size of the tiny task's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WARMUP = 3


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def run_mode(name: str, cmd: list[str], run_dir: Path) -> dict:
    print(f"[{name}] {' '.join(cmd)}", flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [r for r in _rows(run_dir) if r["iteration"] > 0]
    steady = [r for r in rows if r["iteration"] > WARMUP and "eval/reward_mean" not in r]
    first, last = steady[0], steady[-1]
    summary = json.loads((run_dir / "summary.json").read_text())
    med = lambda k: statistics.median(r[k] for r in steady if r.get(k) is not None)  # noqa: E731
    return {
        "iteration_s_median": med("time/iteration_s"),
        "wall_per_iteration_s": (last["wall_s"] - first["wall_s"]) / max(last["iteration"] - first["iteration"], 1),
        "train_s_median": med("time/train_s"),
        "push_s_median": med("time/push_s"),
        "generation_tokens_per_s": med("rollout/tokens_per_s"),
        "push_mb_per_s": med("push/mb_per_s") if "push/mb_per_s" in last else None,
        "staleness_mean": statistics.mean(r.get("replay/staleness_mean", 0.0) for r in steady),
        "baseline_eval": summary["baseline_eval_reward"],
        "final_eval": summary["final_eval_reward"],
        "iterations": summary["iterations"],
        "process_wall_s": round(wall, 1),
    }


def bench_replay(n: int = 4096, batch: int = 64) -> dict:
    """Records/s through the replay buffer: put = claim a prompt + produce its trajectory group
    (atomic script, pipelined); get = the learner's read + commit."""
    import redis

    from services.common.replay import ReplayStore
    from services.common.replay.embedded import EmbeddedRedis
    from services.common.replay.records import group_from_proto, group_to_proto, make_task
    from services.common.types import Completion, PromptRecord, SampleGroup, ScoreResult

    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(tmp, appendonly=True) as server:
        store = ReplayStore(redis.Redis.from_url(server.url), "bench")
        tasks = [make_task(PromptRecord(f"p{i}", "abcde=", "edcba"), 0, 0, 0, 1) for i in range(n)]
        store.feed(tasks)
        comp = Completion([5, 6, 7, 8, 9, 2], [-0.5] * 6, "stop")
        t0 = time.perf_counter()
        done = 0
        while done < n:
            claimed, _ = store.claim_prompts("w", batch, block_ms=10)
            items = [
                (
                    e,
                    group_to_proto(
                        SampleGroup(t.uid, None, [1, 2, 3, 4, 5, 6], [comp], [ScoreResult(1.0, {})], [[0.1] * 6], 0), t
                    ),
                )
                for e, t in claimed
            ]
            store.produce(items)
            done += len(items)
        put = n / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        got = 0
        while got < n:
            entries = store.read_trajectories(batch, block_ms=10)
            groups = [group_from_proto(m) for _, m in entries]
            store.trained_among([g.uid for g in groups])
            store.commit([(e, g.uid) for (e, _), g in zip(entries, groups)])
            got += len(entries)
        get = n / (time.perf_counter() - t0)
    return {"records": n, "batch": batch, "put_records_per_s": round(put), "get_records_per_s": round(get)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/tiny-cpu.yaml")
    ap.add_argument("--model", default="runs/tiny-model")
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--out", default="runs/bench/distributed.json")
    ap.add_argument("--workdir", default="runs/bench")
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for every mode (e.g. rollout_batch_size=256)",
    )
    ap.add_argument("--modes", default="in_process,sync,async", help="which of in_process,sync,async to run")
    ap.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="runs of each mode, interleaved (a noisy machine "
        "drifts; each round's ratio compares runs taken minutes apart)",
    )
    args = ap.parse_args()
    work = Path(args.workdir)
    common = [
        "-c",
        args.config,
        "--set",
        f"model.path={args.model}",
        "--set",
        f"run.iterations={args.iterations}",
        "--set",
        "run.eval_interval=0",
        "--set",
        "run.checkpoint_interval=0",
    ]
    for o in args.overrides:
        common += ["--set", o]
    rlhf = [sys.executable, "-m", "services.cli"]
    modes = {
        "in_process": rlhf + ["train", "--local", *common, "--run-dir", str(work / "in_process")],
        "sync": rlhf + ["up", *common, "--set", "max_staleness=0", "--run-dir", str(work / "sync")],
        "async": rlhf + ["up", *common, "--set", "max_staleness=1", "--run-dir", str(work / "async")],
    }
    modes = {k: v for k, v in modes.items() if k in args.modes.split(",") or k == "in_process"}
    result: dict = {
        "config": args.config,
        "overrides": args.overrides,
        "iterations": args.iterations,
        "warmup_iterations": WARMUP,
        "rounds": args.rounds,
    }
    per_round: list[dict] = []
    for rnd in range(args.rounds):
        this = {}
        for name, cmd in modes.items():
            d = work / name
            if d.exists():
                import shutil

                shutil.rmtree(d)
            this[name] = run_mode(f"{name} {rnd + 1}/{args.rounds}", cmd, d)
        for name in [m for m in ("sync", "async") if m in modes]:
            this[name]["ratio_vs_in_process"] = (
                this[name]["iteration_s_median"] / this["in_process"]["iteration_s_median"]
            )
        per_round.append(this)
    result["per_round"] = per_round
    for name in modes:  # the median run of each mode (by its s/iteration)
        runs = sorted((r[name] for r in per_round), key=lambda r: r["iteration_s_median"])
        result[name] = dict(runs[(len(runs) - 1) // 2])
    for name in [m for m in ("sync", "async") if m in modes]:
        result[name]["ratio_vs_in_process"] = statistics.median(r[name]["ratio_vs_in_process"] for r in per_round)
    policy = Path(args.model) / "model.safetensors"
    result["policy_mb"] = round(policy.stat().st_size / 1e6, 2) if policy.exists() else None
    result["replay"] = bench_replay()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))

    print(
        "\nratio to in-process per round: "
        + ", ".join(
            " / ".join(f"{m} {r[m]['ratio_vs_in_process']:.2f}" for m in ("sync", "async") if m in r) for r in per_round
        )
    )
    print(
        f"{'mode':<11} {'s/iter (median)':>15} {'wall s/iter':>11} {'ratio':>6} {'train s':>8} {'push s':>7} "
        f"{'gen tok/s':>9} {'eval before->after':>19}"
    )
    for name in modes:
        r = result[name]
        ratio = r.get("ratio_vs_in_process", 1.0)
        print(
            f"{name:<11} {r['iteration_s_median']:>15.3f} {r['wall_per_iteration_s']:>11.3f} {ratio:>6.2f} "
            f"{r['train_s_median']:>8.3f} {r['push_s_median']:>7.3f} {r['generation_tokens_per_s']:>9.0f} "
            f"{r['baseline_eval']:>9.3f}->{r['final_eval']:.3f}"
        )
    rp = result["replay"]
    print(
        f"\nreplay (embedded Redis, AOF on): put {rp['put_records_per_s']} records/s, "
        f"get {rp['get_records_per_s']} records/s ({rp['records']} records, batches of {rp['batch']})"
    )
    s = result.get("sync") or result.get("async")
    print(
        f"weight push ({result['policy_mb']} MB policy): {s['push_s_median'] * 1000:.1f} ms median, "
        f"{s['push_mb_per_s']:.0f} MB/s"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
