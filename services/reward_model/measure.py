"""A reward model measured like one, on held-out pairs.

- **Pairwise accuracy**, overall and on the hard pairs apart (two answers of one form, different
  numbers: `pairs.is_hard`): how often chosen scores above rejected.
- **Across prompts** (pairs with the judge's scores, as `rlhf make-prefs` writes them): every
  held-out answer once, and the AUC of the reward model's score for telling a better-judged answer
  from a worse one *of any prompt*. PPO with one sample per prompt and a critic compares rewards
  across prompts, so a model right within each prompt but on another scale per prompt still misleads.
- **Calibration**: the held-out answers in bins of the reward model's score (equal counts), and the
  judge's mean score in each: with a 0/1 judge, the probability of being right at that score.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .preferences import Preference

AUC_CHUNK = 1024


def pair_accuracy(pairs: list[Preference], chosen: torch.Tensor, rejected: torch.Tensor) -> dict:
    """Accuracy over every pair and over the hard ones (None when there are none)."""
    right = (chosen > rejected).float()
    hard = torch.tensor([p.hard for p in pairs], dtype=torch.bool)
    return {
        "accuracy": right.mean().item(),
        "pairs": len(pairs),
        "hard_accuracy": right[hard].mean().item() if hard.any() else None,
        "hard_pairs": int(hard.sum()),
    }


def answers(pairs: list[Preference], chosen: torch.Tensor, rejected: torch.Tensor) -> list[tuple[float, float]]:
    """(reward model score, judge score) of every answer of pairs with the judge's scores, each
    (prompt, text) once."""
    seen: dict[tuple[str, str], tuple[float, float]] = {}
    for p, c, r in zip(pairs, chosen.tolist(), rejected.tolist()):
        if p.gold is not None:
            seen.setdefault((p.prompt, p.chosen), (c, p.gold[0]))
            seen.setdefault((p.prompt, p.rejected), (r, p.gold[1]))
    return list(seen.values())


def auc(scored: list[tuple[float, float]]) -> float | None:
    """P(score(a) > score(b)) over every two answers whose judge scores differ, a judged better
    (ties of the score count half); None without two such answers."""
    if not scored:
        return None
    s = torch.tensor([x for x, _ in scored], dtype=torch.float64)
    g = torch.tensor([y for _, y in scored], dtype=torch.float64)
    won, pairs = 0.0, 0
    for i in range(0, len(s), AUC_CHUNK):  # rows of the comparison at a time: memory ~ AUC_CHUNK x N
        better = g[i : i + AUC_CHUNK, None] > g[None, :]
        si = s[i : i + AUC_CHUNK, None]
        won += ((si > s[None, :]).double() + 0.5 * (si == s[None, :]).double())[better].sum().item()
        pairs += int(better.sum())
    return won / pairs if pairs else None


def calibration(scored: list[tuple[float, float]], bins: int = 8) -> list[dict]:
    """The answers by score in `bins` bins of (about) equal counts: each bin's score range, count
    and the judge's mean score."""
    ordered = sorted(scored)
    bins = max(1, min(bins, len(ordered)))
    out = []
    for b in range(bins):
        chunk = ordered[b * len(ordered) // bins : (b + 1) * len(ordered) // bins]
        if chunk:
            out.append(
                {
                    "score_from": chunk[0][0],
                    "score_to": chunk[-1][0],
                    "answers": len(chunk),
                    "judge_mean": sum(y for _, y in chunk) / len(chunk),
                }
            )
    return out


def measure(pairs: list[Preference], chosen: torch.Tensor, rejected: torch.Tensor) -> dict:
    """Every measure of the module docstring, as numbers (what reward_stats.json keeps)."""
    scored = answers(pairs, chosen, rejected)
    return {**pair_accuracy(pairs, chosen, rejected), "auc": auc(scored), "calibration": calibration(scored)}


def describe(m: dict) -> list[str]:
    """The lines `rlhf train-rm` prints about `measure`'s numbers."""
    line = f"pairwise accuracy {m['accuracy']:.3f} on {m['pairs']} pairs"
    if m["hard_accuracy"] is not None:
        line += f"; on the hard ones {m['hard_accuracy']:.3f} ({m['hard_pairs']} pairs)"
    lines = [line]
    if m["auc"] is not None:
        lines.append(
            f"across prompts: AUC {m['auc']:.3f} (a better-judged answer of any prompt scored above a worse one)"
        )
    if m["calibration"]:
        bins = [f"[{b['score_from']:.2f}, {b['score_to']:.2f}]: {b['judge_mean']:.2f}" for b in m["calibration"]]
        lines.append("calibration (score bin: the judge's mean): " + "  ".join(bins))
    return lines


def plot_calibration(m: dict, out: Path) -> None:
    """calibration.png: the judge's mean score in each score bin of the held-out answers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bins = m["calibration"]
    fig, ax = plt.subplots(figsize=(6, 4))
    mids = [(b["score_from"] + b["score_to"]) / 2 for b in bins]
    ax.plot(mids, [b["judge_mean"] for b in bins], "o-")
    for x, b in zip(mids, bins):
        ax.annotate(str(b["answers"]), (x, b["judge_mean"]), textcoords="offset points", xytext=(0, 6), fontsize=7)
    ax.set_xlabel("reward model score (bin middle; each bin the same number of answers)")
    ax.set_ylabel("judge's mean score (0/1 judge: share right)")
    title = f"held-out answers: AUC {m['auc']:.3f}" if m["auc"] is not None else "held-out answers"
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
