"""The directory of an ensemble of reward models: `ensemble.json` naming its members, each a reward
model directory of its own (`rlhf train-rm` with reward_model.ensemble > 1 writes it; the reward
server serves it as one model, `reward.ensemble_penalty`).

    out/ensemble.json     {"members": ["member-0", "member-1", ...]}
    out/member-I/         a reward model directory each (with its reward_stats.json)
    out/reward_stats.json the ensemble's own held-out measures
"""

from __future__ import annotations

import json
from pathlib import Path

ENSEMBLE_FILE = "ensemble.json"


def members(path: str | Path) -> list[Path]:
    """The reward model directories `path` stands for: its members when it is an ensemble, else
    itself."""
    path = Path(path)
    index = path / ENSEMBLE_FILE
    if not index.is_file():
        return [path]
    try:
        names = json.loads(index.read_text())["members"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{index}: not an ensemble index ({type(e).__name__}: {e})") from None
    if not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{index}: 'members' must be a non-empty list of directory names")
    return [path / n for n in names]


def first_member(path: str | Path) -> Path:
    """The reward model a single model is read from (an ensemble's first member)."""
    return members(path)[0]


def write_ensemble(out: Path, names: list[str]) -> None:
    (out / ENSEMBLE_FILE).write_text(json.dumps({"members": names}, indent=2) + "\n")
