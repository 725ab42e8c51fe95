"""Whether a command may go on in a run directory: one that holds a run of another mode, or of
another config, is refused by name before anything loads.

What a run directory says of its run:

    config.yaml              the resolved config it last started with (training/runlog.py)
    checkpoints/iter_N/      its checkpoints (their format: services/common/checkpoints.py)

A run goes on from its newest checkpoint, which only the mode that wrote it can read; and the
keys of IDENTITY make it the run it is (the model trained, its optimiser's shapes, the prompts
its sampler's place is in): a config that changes one starts another run, in another directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from ..common.checkpoints import Mode, newest_checkpoint
from ..common.checkpoints import mode as checkpoint_mode

if TYPE_CHECKING:
    from ..common.config import Config

IDENTITY = ("model.path", "model.lora.rank", "adv_estimator", "data.train")


def run_dir_conflict(cfg: Config, mode: Mode) -> str | None:
    """Why `mode` may not go on in cfg.run.run_dir, or None."""
    run_dir = Path(cfg.run.run_dir)
    newest = newest_checkpoint(run_dir)
    if newest is not None and checkpoint_mode(newest) is not mode:
        return (
            f"{run_dir} holds a run of {checkpoint_mode(newest).value} ({newest.relative_to(run_dir)}), which "
            f"{mode.value} cannot go on from; give this run a directory of its own (--run-dir DIR)"
        )
    changed = config_changes(run_dir / "config.yaml", cfg)
    if changed:
        return (
            f"{run_dir} holds a run of another config ({'; '.join(changed)}); give this run a directory of its "
            "own (--run-dir DIR), or set those keys back to go on with that run"
        )
    return None


def config_changes(saved: Path, cfg: Config) -> list[str]:
    """The IDENTITY keys on which the config saved in a run directory and `cfg` differ, each as
    "KEY: THEIRS there, OURS here"; [] when nothing is saved (or it cannot be read)."""
    try:
        theirs = yaml.safe_load(saved.read_text())
    except (OSError, yaml.YAMLError):
        return []
    ours = cfg.model_dump(mode="json")
    changes = []
    for key in IDENTITY:
        a, b = _at(theirs, key), _at(ours, key)
        if a is not None and not _same(a, b):  # None: a config saved before the key was
            changes.append(f"{key}: {a} there, {b} here")
    return changes


def _at(data, dotted: str):
    for part in dotted.split("."):
        data = data.get(part) if isinstance(data, dict) else None
    return data


def _same(a, b) -> bool:
    """Equal values; two paths to one existing file or directory are the same too."""
    if a == b:
        return True
    if not (isinstance(a, str) and isinstance(b, str)):
        return False
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()
