"""The checkpoint format: every name and shape of a run's checkpoints is written and read here.

    RUN_DIR/checkpoints/iter_N/   one checkpoint, N the iteration (6 digits)
        learner.pt                the learner's state, a dict; written last and atomically, so a
                                  checkpoint with it is complete. Its "learner" entry is the
                                  trainer's state, whose "policy" holds the actor's weights
                                  (absent when the actor is sharded: then actor/ holds them)
        critic/                   the critic's weights and optimiser (the critic server writes it
                                  under `rlhf up`, the run's process under `train --local`); its
                                  critic_optim.pt is written and read here (`CriticOptim`)
        actor/                    a sharded actor (the learner service with learner.nproc > 1)
        config.json, weights      `rlhf train --local` only: the policy as a Hugging Face
                                  directory beside learner.pt (a checkpoint any tool can load)
    RUN_DIR/final/, best/         the policy as a Hugging Face directory

Beside them, weights over a base model (the Tinker API's sampler weights, tinker.root/<run>/
sampler_weights/<name>/): `weights.safetensors` of the tensors that differ from the base (a LoRA
merged into its layers), `meta.json`, no config.json (`write_overlay`, `read_overlay`).

The rest of learner.pt's entries belong to the mode that wrote it (`rlhf up`: the feeder's place,
counters, the trajectories to acknowledge; `train --local`: the prompt sampler's place and the
loop's counters); only that mode goes on from it (`mode`).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path

import torch

LEARNER_STATE = "learner.pt"
CRITIC_DIR = "critic"
ACTOR_DIR = "actor"


class Mode(str, enum.Enum):
    """The mode that wrote a checkpoint, as its messages name it."""

    LOCAL = "`rlhf train --local`"
    DISTRIBUTED = "`rlhf up`"


def checkpoints_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_dir(run_dir: str | Path, iteration: int) -> Path:
    return checkpoints_root(run_dir) / f"iter_{iteration:06d}"


def checkpoint_iteration(path: str | Path) -> int | None:
    """The iteration of a checkpoint directory `iter_N` (None for any other name)."""
    try:
        return int(Path(path).name.split("_", 1)[1])
    except (IndexError, ValueError):
        return None


def is_complete(path: str | Path) -> bool:
    return (Path(path) / LEARNER_STATE).is_file()


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's checkpoints that were fully written, oldest first."""
    return sorted(p for p in checkpoints_root(run_dir).glob("iter_*") if is_complete(p))


def newest_checkpoint(run_dir: str | Path) -> Path | None:
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def mode(path: str | Path) -> Mode:
    """The mode that wrote the checkpoint `path`: `train --local` keeps the policy beside learner.pt."""
    return Mode.LOCAL if (Path(path) / "config.json").is_file() else Mode.DISTRIBUTED


def write_state(path: str | Path, state: dict) -> None:
    """`state` as the checkpoint directory `path`'s learner.pt, replacing it at once (a crash
    leaves the old file or the new one, never half of one)."""
    tmp = Path(path) / (LEARNER_STATE + ".tmp")
    torch.save(state, tmp)
    tmp.replace(Path(path) / LEARNER_STATE)


def read_state(path: str | Path, weights_only: bool = True) -> dict:
    """The learner.pt of the checkpoint directory `path`, on the CPU (never N copies on one GPU)."""
    file = Path(path) / LEARNER_STATE
    if not file.is_file():
        raise FileNotFoundError(f"{path} is no complete checkpoint ({LEARNER_STATE} missing)")
    return torch.load(file, map_location="cpu", weights_only=weights_only)


def policy_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The actor's weights in the checkpoint `path` (either mode), for the model it was trained
    from; a clear error for checkpoints that hold them otherwise (sharded, LoRA adapters)."""
    trainer = read_state(path)["learner"]
    if "policy" not in trainer:
        raise ValueError(
            f"{path} is a sharded checkpoint (its actor is in {Path(path) / ACTOR_DIR}); use the run's final/ "
            "or best/ instead"
        )
    policy = trainer["policy"]
    if any(".lora_" in k for k in policy):
        raise ValueError(
            f"{path} holds LoRA adapters in a PEFT wrapper; use the run's final/ or best/ (merged) instead"
        )
    return policy


# ------------------------------------------------------------------ the critic's optimiser state
CRITIC_OPTIM = "critic_optim.pt"  # in a critic directory, beside its weights


@dataclass(frozen=True)
class CriticOptim:
    """What a critic directory's critic_optim.pt holds: the critic's step count, and its
    optimiser's state either whole (`state`: one process's, `critic.nproc` 1) or as the folder,
    relative to the directory, where a sharded critic wrote its shards (`sharded`)."""

    steps: int
    state: dict | None = None
    sharded: str | None = None


def write_critic_optim(path: str | Path, optim: CriticOptim) -> None:
    entry = {"sharded_optimizer": optim.sharded} if optim.sharded is not None else {"optimizer": optim.state}
    torch.save({**entry, "steps": optim.steps}, Path(path) / CRITIC_OPTIM)


def read_critic_optim(path: str | Path, map_location="cpu") -> CriticOptim:
    """The critic_optim.pt of the critic directory `path`; ValueError saying why it cannot be read
    (unreadable, no step count, no optimiser state of either shape)."""
    try:
        raw = torch.load(Path(path) / CRITIC_OPTIM, map_location=map_location, weights_only=True)
        steps = int(raw["steps"])
    except Exception as e:
        raise ValueError(f"{CRITIC_OPTIM}: cannot be read ({type(e).__name__}: {e})") from None
    if "sharded_optimizer" in raw:
        return CriticOptim(steps, sharded=str(raw["sharded_optimizer"]))
    if "optimizer" not in raw:
        raise ValueError(f"{CRITIC_OPTIM}: holds no optimiser state")
    return CriticOptim(steps, state=raw["optimizer"])


# ------------------------------------------------------------------ weights over a base model
OVERLAY_WEIGHTS, OVERLAY_META = "weights.safetensors", "meta.json"


def write_overlay(path: str | Path, weights: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in weights.items()}, str(Path(path) / OVERLAY_WEIGHTS))
    (Path(path) / OVERLAY_META).write_text(json.dumps({"tensors": len(weights)}))


def is_overlay(path: str | Path) -> bool:
    p = Path(path)
    return (p / OVERLAY_WEIGHTS).is_file() and (p / OVERLAY_META).is_file() and not (p / "config.json").exists()


def read_overlay(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(path) / OVERLAY_WEIGHTS))
