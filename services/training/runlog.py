"""What a training run leaves in its run directory, and what it shows on the terminal.

DIR/config.yaml     the resolved config
DIR/metrics.jsonl   one JSON object per iteration (eval/* keys when evaluated)
DIR/summary.json    baseline_eval_reward, final_eval_reward, iterations, wall_s, ...
DIR/curves.png      train and held-out reward, and KL to the reference, per iteration
DIR/tensorboard/    every row's numbers as TensorBoard scalars (and W&B when configured; tracking.py)
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..common.config import dump_config
from .tracking import open_sinks, scalars

if TYPE_CHECKING:
    from ..common.config import Config

log = logging.getLogger(__name__)

PROGRESS_KEYS = [
    ("reward", "reward/score_mean", "{:.3f}"),
    ("eval", "eval/reward_mean", "{:.3f}"),
    ("kl", "ppo/kl_ref", "{:.4f}"),
    ("clip", "ppo/pg_clipfrac", "{:.3f}"),
    ("ent", "ppo/entropy_rollout", "{:.3f}"),
    ("vf", "critic/vf_loss", "{:.4f}"),
    ("ev", "critic/explained_variance", "{:.2f}"),
    ("tok/s", "rollout/tokens_per_s", "{:.0f}"),
    ("s/it", "time/iteration_s", "{:.2f}"),
]


def unscored_eval(reward: float, unscored: float) -> str:
    """The eval column of an eval some of whose rows could not be scored: 'eval unscored' when
    none could (its 0 is no reward), else the mean with the share left unscored."""
    if unscored >= 1.0:
        return "eval unscored"
    if unscored > 0.0:
        return f"eval {reward:.3f} ({unscored:.0%} unscored)"
    return f"eval {reward:.3f}"


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def shown_path(path: str | Path) -> str:
    """A path as a line shows it: relative to the current directory when under it (what a reader
    typed), else as it is."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


class RunLog:
    def __init__(self, run_dir: str | Path, cfg: Config, mode: str, stream=None, resume_from: int | None = None):
        """`resume_from`: keep the rows of iterations up to this one (a run resumed from its
        checkpoint at that iteration) instead of starting metrics.jsonl afresh."""
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "config.yaml").write_text(dump_config(cfg))
        self.metrics_path = self.dir / "metrics.jsonl"
        self.rows: list[dict] = []
        if resume_from is not None and self.metrics_path.exists():
            text = self.metrics_path.read_text()
            if not text.endswith("\n"):  # a crash cut the last row short: its iteration is redone
                text = text[: text.rfind("\n") + 1]
            for line in text.splitlines():
                if line.strip():
                    row = json.loads(line)
                    if row.get("iteration", 0) <= resume_from:
                        self.rows.append(row)
        # rewritten whole, then renamed over the old file: a reader never sees it half-written
        fresh = self.metrics_path.with_name(self.metrics_path.name + ".tmp")
        fresh.write_text("".join(json.dumps(r) + "\n" for r in self.rows))
        os.replace(fresh, self.metrics_path)
        self.cfg, self.mode, self.stream = cfg, mode, stream or sys.stdout
        self.t0 = time.time() - (self.rows[-1].get("wall_s", 0.0) if self.rows else 0.0)
        self.sinks = open_sinks(self.dir, cfg, resume_from)

    def _append(self, row: dict) -> None:
        row = {k: _clean(v) for k, v in row.items()}
        self.rows.append(row)
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        self._track(row)

    def _track(self, row: dict) -> None:
        """The row into every tracker; one that fails is dropped (the numbers stay in metrics.jsonl)."""
        values = scalars(row)
        for sink in list(self.sinks):
            try:
                sink.log(row["iteration"], values)
            except Exception as e:
                log.warning(
                    "%s tracking failed (%s: %s); it is off for the rest of the run", sink.name, type(e).__name__, e
                )
                self.sinks.remove(sink)
                self._close(sink)

    @staticmethod
    def _close(sink) -> None:
        try:
            sink.close()
        except Exception as e:
            log.warning("closing %s tracking failed: %s", sink.name, e)

    def close(self) -> None:
        """Close the trackers (flushes their files); idempotent."""
        while self.sinks:
            self._close(self.sinks.pop())

    def log_eval(self, iteration: int, metrics: dict) -> None:
        self._append({"iteration": iteration, "wall_s": round(time.time() - self.t0, 3), **metrics})
        self._print(iteration, metrics)

    def log_iteration(self, iteration: int, metrics: dict) -> None:
        self._append({"iteration": iteration, "wall_s": round(time.time() - self.t0, 3), **metrics})
        if iteration % self.cfg.run.log_every == 0 or "eval/reward_mean" in metrics:
            self._print(iteration, metrics)

    def _print(self, iteration: int, metrics: dict) -> None:
        parts = [f"iter {iteration:>4}/{self.cfg.run.iterations}"]
        for label, key, fmt in PROGRESS_KEYS:
            if key == "eval/reward_mean" and "eval/unscored" in metrics:
                parts.append(unscored_eval(metrics[key], metrics["eval/unscored"]))
            elif isinstance(metrics.get(key), (int, float)) and math.isfinite(metrics[key]):
                parts.append(f"{label} {fmt.format(metrics[key])}")
        print("  ".join(parts), file=self.stream, flush=True)

    def finish(self, baseline: float, final: float, iterations: int, wall_s: float, **extra) -> dict:
        summary = {
            "mode": self.mode,
            "baseline_eval_reward": baseline,
            "final_eval_reward": final,
            "improvement": final - baseline,
            "iterations": iterations,
            "wall_s": round(wall_s, 2),
            "adv_estimator": self.cfg.adv_estimator,
            **extra,
        }
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.close()
        try:
            plot_curves(self.rows, self.dir / "curves.png")
        except Exception as e:  # a plot is a convenience; the numbers are in metrics.jsonl
            print(f"warning: could not draw curves.png: {e}", file=sys.stderr)
        print(
            f"done: held-out reward {baseline:.3f} -> {final:.3f} in {iterations} iteration{'s' * (iterations != 1)}, "
            f"{wall_s:.0f}s; results in {shown_path(self.dir)}",
            file=self.stream,
            flush=True,
        )
        return summary


def plot_curves(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(key):
        pts = [(r["iteration"], r[key]) for r in rows if r.get(key) is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    x, y = series("reward/score_mean")
    ax1.plot(x, y, label="train reward", alpha=0.7)
    x, y = series("eval/reward_mean")
    ax1.plot(x, y, "o-", label="held-out reward")
    ax1.set_xlabel("iteration")
    ax1.set_ylabel("reward")
    ax1.legend()
    ax1.grid(alpha=0.3)
    x, y = series("ppo/kl_ref")
    ax2.plot(x, y, label="KL to reference", color="tab:red")
    x, y = series("ppo/approx_kl")
    ax2.plot(x, y, label="KL old->new (per update)", color="tab:purple", alpha=0.6)
    ax2.set_xlabel("iteration")
    ax2.set_ylabel("KL")
    ax2.legend()
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
