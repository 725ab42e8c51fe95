"""A reward model's directory, as `rlhf train-rm` writes it and the reward server and the critic
(`critic.init_from_reward_model`) read it: its normalisation (`reward_stats.json`) and, for an
ensemble of reward models, `ensemble.json` naming its members, each a reward
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


def is_ensemble(path: str | Path) -> bool:
    return (Path(path) / ENSEMBLE_FILE).is_file()


def reward_stats(path: str | Path) -> tuple[float, float]:
    """(mean, std) of a reward model's score on its training answers (its reward_stats.json, as
    `rlhf train-rm` writes it): what normalises it; the std at least 1e-6."""
    stats_file = Path(path) / "reward_stats.json"
    if not stats_file.exists():
        raise ValueError(f"{stats_file} is missing (`rlhf train-rm` writes it); it normalises the reward model")
    stats = json.loads(stats_file.read_text())
    return float(stats["mean"]), max(float(stats["std"]), 1e-6)


def write_ensemble(out: Path, names: list[str] | None) -> None:
    """Writes the index of an ensemble in `out`, or (`names` None: one model is written there)
    removes an earlier one, which would otherwise go on being served."""
    index = out / ENSEMBLE_FILE
    if names is None:
        index.unlink(missing_ok=True)
    else:
        index.write_text(json.dumps({"members": names}, indent=2) + "\n")


def reward_logits(model, tokenizer, texts: list[str], device, max_length: int | None = None):
    """The reward model's forward, one for training (reward_model/train.py) and serving
    (reward/scorer.py): the texts tokenised in one call (padded; cut at `max_length` tokens when
    given), the logit of the single label at each text's last token, as float32 (batch,)."""
    kw = dict(truncation=True, max_length=max_length) if max_length else {}
    enc = tokenizer(list(texts), return_tensors="pt", padding=True, **kw).to(device)
    return model(**enc).logits[:, 0].float()
