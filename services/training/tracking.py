"""Experiment tracking: every row of metrics.jsonl, as scalars at step = its iteration, into
TensorBoard event files (DIR/tensorboard, `run.tensorboard`) and, when `run.wandb_project` is
set, a Weights & Biases run. The run log (`runlog.py`) feeds them, so only the learner and the
in-process trainer track; a tracker that fails is dropped with one warning and the run goes on.

    sinks = open_sinks(run_dir, cfg, resume_from=None)
    for s in sinks: s.log(iteration, scalars(row))
    for s in sinks: s.close()

    tensorboard --logdir runs/tiny-cpu/tensorboard
"""

from __future__ import annotations

import importlib.util
import logging
import math
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from ..common.config import Config

log = logging.getLogger(__name__)

TB_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_id"  # a resumed run logs into the same W&B run
SECRET_KEYS = (("rpc", "auth_token"), ("replay", "password"))


def scalars(row: dict) -> dict[str, float]:
    """The numeric metrics of a metrics.jsonl row (booleans as 0/1), without `iteration` (the
    step) and without missing or non-finite values."""
    out = {}
    for k, v in row.items():
        if k != "iteration" and isinstance(v, (int, float)) and math.isfinite(v):
            out[k] = float(v)
    return out


def installed(package: str) -> bool:
    """Whether `package` can be imported (without importing it: W&B takes a second)."""
    if package in sys.modules:  # imported already, or blocked (None)
        return sys.modules[package] is not None
    return importlib.util.find_spec(package) is not None


def tracking_errors(cfg: Config) -> list[str]:
    """What stops the configured trackers from starting here: W&B asked for but not installed."""
    if cfg.run.wandb_project and not installed("wandb"):
        return [
            f"run.wandb_project: {cfg.run.wandb_project!r} needs the wandb package, which is not installed: "
            "`pip install wandb` (then `wandb login`), or set run.wandb_project: null"
        ]
    return []


def redacted(config: dict) -> dict:
    """A dumped config without its secrets (the auth token, the Redis password, a password in
    replay.url), for a tracker that sends the config elsewhere."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in config.items()}
    for section, key in SECRET_KEYS:
        if out.get(section, {}).get(key):
            out[section][key] = "<redacted>"
    url = out.get("replay", {}).get("url")
    if url and "@" in url:
        scheme, _, rest = url.partition("://")
        out["replay"]["url"] = f"{scheme}://<redacted>@{rest.rpartition('@')[2]}"
    return out


class TensorBoardSink:
    """Scalars into DIR/tensorboard; a resumed run hides the steps after the one it resumed from."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, resume_from: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        purge = resume_from + 1 if resume_from is not None else None
        self.writer = SummaryWriter(str(Path(run_dir) / TB_DIR), purge_step=purge)

    def log(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()  # a killed process loses nothing it logged

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A Weights & Biases run named after the run directory, its id kept in DIR/wandb_id. Rows are
    plotted against their `iteration` (a metric of its own, not W&B's step, which only goes up):
    a resumed run's redone iterations are logged too, as in metrics.jsonl."""

    name = "wandb"

    def __init__(self, run_dir: Path, cfg: Config):
        import wandb

        rc = cfg.run
        id_file = Path(run_dir) / WANDB_ID_FILE
        if not id_file.exists():
            id_file.write_text(uuid.uuid4().hex[:12] + "\n")
        self.run = wandb.init(
            project=rc.wandb_project,
            entity=rc.wandb_entity,
            mode=rc.wandb_mode,
            dir=str(run_dir),
            name=Path(run_dir).resolve().name,
            id=id_file.read_text().strip(),
            resume="allow",
            config=redacted(cfg.model_dump(mode="json")),
        )
        self.run.define_metric("iteration")
        self.run.define_metric("*", step_metric="iteration")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log({**values, "iteration": step})

    def close(self) -> None:
        self.run.finish()


def open_sinks(run_dir: str | Path, cfg: Config, resume_from: int | None = None) -> list:
    """The trackers `cfg.run` asks for. W&B asked for but not installed is a ValueError (one
    line, how to install it); TensorBoard's package missing is one warning (it is on by default);
    a tracker that fails to start (W&B without an API key or a network, say) is one warning and
    the run goes on without it."""
    errors = tracking_errors(cfg)
    if errors:
        raise ValueError(errors[0])
    makers: list[tuple[str, Callable[[], object]]] = []
    if cfg.run.tensorboard:
        if not installed("tensorboard"):
            log.warning(
                "run.tensorboard: the tensorboard package is not installed (`pip install tensorboard`); "
                "no event files are written"
            )
        else:
            makers.append(("tensorboard", lambda: TensorBoardSink(Path(run_dir), resume_from)))
    if cfg.run.wandb_project:
        makers.append(("wandb", lambda: WandbSink(Path(run_dir), cfg)))
    sinks: list = []
    for name, make in makers:
        try:
            sinks.append(make())
        except Exception as e:  # tracking never stops training
            log.warning("%s tracking could not start, the run goes on without it: %s: %s", name, type(e).__name__, e)
    return sinks
