"""One GPU per generation replica when Compose scales one service over several GPUs.

`docker compose up --scale generation=N` starts N identical containers: Compose cannot give each
its own `device_ids`. So the service is given every generation GPU (RLHF_GENERATION_GPUS=0,1,2,3;
Docker puts that list in NVIDIA_VISIBLE_DEVICES and the container sees them as devices 0..k-1)
and each replica, before CUDA starts, takes the first slot nobody holds: an exclusive `flock` on
DIR/generation-gpu-<i>.lock in a directory every replica mounts (the `runs` volume). The lock
lives as long as the process: a replica that dies frees its GPU for the one Docker restarts.
The replica then sets CUDA_VISIBLE_DEVICES to its slot, so vLLM and torch see one GPU.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
from pathlib import Path
from typing import Mapping, MutableMapping

log = logging.getLogger(__name__)

_held: list = []  # the open lock file: kept for the life of the process


def visible_gpus(env: Mapping[str, str] | None = None) -> list[str]:
    """The GPU ids Docker gave this container (NVIDIA_VISIBLE_DEVICES), [] when unknown or all."""
    value = (os.environ if env is None else env).get("NVIDIA_VISIBLE_DEVICES", "")
    if value.strip().lower() in ("", "all", "void", "none"):
        return []
    return [v.strip() for v in value.split(",") if v.strip()]


def claim_gpu(claim_dir: str | os.PathLike, env: MutableMapping[str, str] | None = None) -> int | None:
    """Take a free GPU slot among the container's GPUs and point CUDA_VISIBLE_DEVICES at it; the
    slot index, or None when there is nothing to choose (one GPU or none, or CUDA_VISIBLE_DEVICES
    already set by the user). Raises RuntimeError when every slot is taken."""
    environ: MutableMapping[str, str] = os.environ if env is None else env
    gpus = visible_gpus(environ)
    if len(gpus) < 2 or environ.get("CUDA_VISIBLE_DEVICES"):
        return None
    directory = Path(claim_dir)
    directory.mkdir(parents=True, exist_ok=True)
    for slot in range(len(gpus)):
        f = open(directory / f"generation-gpu-{slot}.lock", "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            continue
        f.seek(0)
        f.truncate()
        f.write(f"{socket.gethostname()} pid {os.getpid()}\n")
        f.flush()
        _held.append(f)
        environ["CUDA_VISIBLE_DEVICES"] = str(slot)
        environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # slot i is the i-th id of the list
        log.info(
            "generation replica on GPU slot %d of the %d this service has (NVIDIA_VISIBLE_DEVICES=%s)",
            slot,
            len(gpus),
            ",".join(gpus),
        )
        return slot
    raise RuntimeError(
        f"every GPU of this generation service ({','.join(gpus)}) is taken by another replica "
        f"(locks in {directory}): scale generation to at most {len(gpus)}, or list more ids in "
        f"RLHF_GENERATION_GPUS"
    )
