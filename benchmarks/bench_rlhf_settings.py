"""Each anti-hacking setting's effect on RLHF with a learned reward: PPO with a critic under
`rlhf up` (configs/smollm2-rlhf.yaml, the reward model of `make run-smollm2-rlhf`'s first two
steps), once per setting and seed, the gold judge held out; then the gold and proxy curves side
by side (benchmarks/compare_runs.py) and, per run, the gold at the end (`final/`), its best and
its largest fall below the best so far. A benchmark: it measures and prints (each run ~30
minutes on a 2-core CPU).

    python benchmarks/bench_rlhf_settings.py [--settings baseline,penalty,...] [--seeds 0,1]
        [--reward-model runs/smollm2-rlhf/reward-model] [--out runs/smollm2-rlhf/settings] [-- --set k=v ...]

The settings (each on top of the config as it is):

    baseline        nothing more
    ensemble        reward.model_path an ensemble (--ensemble DIR: `rlhf train-rm --set
                    reward_model.ensemble=3`), its mean
    penalty         the ensemble, mean - 1.0 x std (reward.ensemble_penalty)
    clip            reward_clip 1.5 (of the normalised reward)
    critic-from-rm  critic.init_from_reward_model
    target-kl       target_kl 0.3 (the adaptive KL controller)
    rollback        run.gold_drop 0.05 (roll back to best/)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.compare_runs import rows  # noqa: E402

SETTINGS = {
    "baseline": [],
    "ensemble": ["reward.model_path={ensemble}"],
    "penalty": ["reward.model_path={ensemble}", "reward.ensemble_penalty=1.0"],
    "clip": ["reward_clip=1.5"],
    "critic-from-rm": ["critic.init_from_reward_model=true"],
    "target-kl": ["target_kl=0.3"],
    "rollback": ["run.gold_drop=0.05"],
}


def gold_summary(run_dir: Path) -> dict:
    """The held-out (gold) reward at the end, at its best, and the largest fall below the best so far."""
    evals = [r["eval/reward_mean"] for r in rows(run_dir) if "eval/reward_mean" in r]
    best, fall = float("-inf"), 0.0
    for v in evals:
        best = max(best, v)
        fall = max(fall, best - v)
    return {"start": evals[0], "end": evals[-1], "best": best, "largest_fall": fall, "evaluations": len(evals)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated names of the settings")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--config", default="configs/smollm2-rlhf.yaml")
    ap.add_argument("--reward-model", default="runs/smollm2-rlhf/reward-model")
    ap.add_argument("--ensemble", default="runs/smollm2-rlhf/reward-ensemble")
    ap.add_argument("--out", default="runs/smollm2-rlhf/settings")
    ap.add_argument("extra", nargs="*", help="after --: more `rlhf up` arguments for every run")
    args = ap.parse_args()
    names = [n for n in args.settings.split(",") if n]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        sys.exit(f"unknown settings {unknown}; known: {list(SETTINGS)}")
    runs = []
    for name in names:
        for seed in [int(s) for s in args.seeds.split(",")]:
            run_dir = Path(args.out) / f"{name}-s{seed}"
            sets = [f"reward.model_path={args.reward_model}", f"run.seed={seed}"]
            sets += [s.format(ensemble=args.ensemble) for s in SETTINGS[name]]
            cmd = [str(ROOT / ".venv" / "bin" / "rlhf"), "up", "-c", args.config, "--run-dir", str(run_dir)]
            cmd += [a for s in sets for a in ("--set", s)] + args.extra
            print("$", " ".join(cmd), flush=True)
            if not (run_dir / "summary.json").exists():
                subprocess.run(cmd, check=True)
            runs.append((name, seed, run_dir))
    print("\n| setting | seed | gold start | gold end (final/) | gold best | largest fall below the best |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, seed, run_dir in runs:
        g = gold_summary(run_dir)
        print(f"| {name} | {seed} | {g['start']:.3f} | {g['end']:.3f} | {g['best']:.3f} | {g['largest_fall']:.3f} |")
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compare_runs.py"), *[str(r) for *_, r in runs]])
    (Path(args.out) / "settings.json").write_text(
        json.dumps({f"{n}-s{s}": gold_summary(r) for n, s, r in runs}, indent=2)
    )


if __name__ == "__main__":
    main()
