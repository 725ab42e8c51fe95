"""What `rlhf train-rm` tells of a run (train.py trains): the plan line, metrics.jsonl as it goes,
one line per step and per held-out evaluation, the held-out measures in reward_stats.json, and
at the end curves.png, calibration.png and where the model is."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from .measure import describe, plot_calibration


def fmt_s(s: float) -> str:
    m, s = divmod(int(s), 60)
    return f"{m}m{s:02d}s"


def plan_line(base: str, train: list, held_out: list, rc, steps_per_epoch: int, lora: bool) -> str:
    hard = sum(p.hard for p in held_out)
    return (
        f"reward model on {base}: {len(train)} training pairs, {len(held_out)} held out"
        + (f" ({hard} hard)" if hard else "")
        + f"; {rc.epochs} epoch(s) of {steps_per_epoch} steps of {rc.batch_size} pairs"
        + (", LoRA" if lora else "")
        + (", bf16" if rc.bf16 else "")
    )


class MetricsLog:
    """metrics.jsonl at `path`, a row written (and flushed) as it comes; `rows` keeps them for the
    curves."""

    def __init__(self, path: Path):
        self.rows: list[dict] = []
        self.file = path.open("w")

    def record(self, row: dict) -> None:
        self.rows.append(row)
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def step_line(row: dict, total: int, per_step: float) -> str:
    """The progress line of an optimiser step (`row`: its metrics row)."""
    return (
        f"step {row['step']:4d}/{total}  epoch {row['epoch']}  loss {row['loss']:.4f}  acc {row['accuracy']:.3f}  "
        f"lr {row['lr']:.1e}  {row['texts']} texts  {per_step:.2f} s/step  "
        f"eta {fmt_s(per_step * (total - row['step']))}"
    )


def held_out_line(epoch: int, last: dict, before: dict | None) -> str:
    """The line of an epoch's held-out evaluation, with the accuracy before training when known."""
    return (
        f"held-out (epoch {epoch}): {describe(last['measured'])[0]}"
        + (f" (before training {before['accuracy']:.3f})" if before else "")
        + f", loss {last['loss']:.4f}"
    )


def held_out_stats(m: dict) -> dict:
    return {
        "held_out_accuracy": m["accuracy"],
        "held_out_hard_accuracy": m["hard_accuracy"],
        "held_out_hard_pairs": m["hard_pairs"],
        "held_out_auc": m["auc"],
        "calibration": m["calibration"],
    }


def draw(plot: Callable[[], None], say: Callable[[str], None]) -> None:
    try:
        plot()
    except Exception as e:  # a missing plotting library never loses the model
        say(f"warning: could not draw: {e}")


def report(out: Path, rows: list[dict], last: dict | None, stats: dict, say: Callable[[str], None]) -> None:
    """The curves and calibration drawn, the held-out measures and where the model is, printed."""
    draw(lambda: plot_rm_curves(rows, out / "curves.png"), say)
    if last:
        for line in describe(last["measured"])[1:]:
            say(line)
        if last["measured"]["calibration"]:
            draw(lambda: plot_calibration(last["measured"], out / "calibration.png"), say)
    say(
        f"reward model written to {out} in {fmt_s(stats['seconds'])}: reward mean {stats['mean']:.3f}, std "
        f"{stats['std']:.3f} on its training pairs; serve it with reward.type: model, reward.model_path: {out}"
    )


def report_ensemble(measured: dict, penalty: float, out: Path, say: Callable[[str], None]) -> None:
    """The ensemble's held-out measures printed, its calibration drawn."""
    say(f"the ensemble on the held-out pairs (mean - {penalty:g} x std of the members' normalised scores):")
    for line in describe(measured):
        say("  " + line)
    if measured["calibration"]:
        draw(lambda: plot_calibration(measured, out / "calibration.png"), say)


def plot_rm_curves(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot([r["step"] for r in steps], [r["loss"] for r in steps], label="pairwise loss (train batch)")
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss")
    ax1.grid(alpha=0.3)
    ax1.legend()
    ax2.plot([r["step"] for r in steps], [r["accuracy"] for r in steps], alpha=0.5, label="train batch accuracy")
    ax2.plot([r["step"] for r in evals], [r["eval/accuracy"] for r in evals], "o-", label="held-out accuracy")
    ax2.set_xlabel("step")
    ax2.set_ylabel("pairwise accuracy")
    ax2.set_ylim(0, 1)
    ax2.grid(alpha=0.3)
    ax2.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
