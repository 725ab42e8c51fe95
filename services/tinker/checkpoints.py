"""tinker:// paths and where they live: `tinker://<training run>/<kind>/<name>` is the directory
ROOT/<training run>/<kind>/<name> (ROOT = tinker.root), the training run being the model id that
saved it.

    weights/<name>/state.pt                  save_state: the trainable tensors and the optimiser's
                                             state (torch.save, read back with weights_only)
    sampler_weights/<name>/weights.safetensors  save_weights_for_sampler: what the sampler loads
                                             over the base model (the LoRA-merged layers, or all)
    <training run>/run.json                  the run's model: base model, LoRA rank and layers,
                                             the client's user_metadata

Every segment is a plain name (letters, digits, `._:-`, not starting with a dot): nothing a client
sends can name a path outside ROOT. A directory is written under a temporary name and renamed
into place, so a reader never sees half of one."""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .protocol import ApiError

Kind = Literal["weights", "sampler_weights"]
KINDS: tuple[Kind, ...] = ("weights", "sampler_weights")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,255}$")
RUN_META = "run.json"


def check_name(name: str, what: str) -> str:
    if not NAME.match(name):
        raise ApiError(
            400,
            f"{what}: {name[:80]!r} is not a plain name (letters, digits and ._:- , not starting with a dot, "
            "at most 256 characters)",
            param=what,
        )
    return name


@dataclass(frozen=True)
class TinkerPath:
    run: str
    kind: Kind
    name: str

    @property
    def uri(self) -> str:
        return f"tinker://{self.run}/{self.kind}/{self.name}"

    @classmethod
    def parse(cls, uri: str, kind: Kind | None = None, what: str = "path") -> "TinkerPath":
        """`tinker://RUN/KIND/NAME`; with `kind`, only that kind."""
        parts = uri.removeprefix("tinker://").split("/") if uri.startswith("tinker://") else []
        if len(parts) != 3 or parts[1] not in KINDS:
            raise ApiError(400, f"{what}: {uri[:120]!r} is not tinker://<training run>/<kind>/<name>", param=what)
        found = next(k for k in KINDS if k == parts[1])
        if kind is not None and found != kind:
            raise ApiError(400, f"{what}: {uri[:120]!r} is a {found} checkpoint; this takes {kind}", param=what)
        return cls(check_name(parts[0], what), found, check_name(parts[2], what))


class Store:
    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()

    def dir(self, path: TinkerPath) -> Path:
        out = (self.root / path.run / path.kind / path.name).resolve()
        if not out.is_relative_to(self.root):  # check_name makes this impossible; kept as the last word
            raise ApiError(400, f"{path.uri}: outside the server's checkpoint directory", param="path")
        return out

    def exists(self, path: TinkerPath) -> bool:
        return self.dir(path).is_dir()

    def found(self, path: TinkerPath) -> Path:
        """The directory of an existing checkpoint."""
        d = self.dir(path)
        if not d.is_dir():
            raise ApiError(404, f"no checkpoint {path.uri}", param="path", code="checkpoint_not_found")
        return d

    def write(self, path: TinkerPath, fill, overwrite: bool = True) -> None:
        """`fill(directory)` into a temporary directory, then renamed to `path`'s."""
        final = self.dir(path)
        if final.exists() and not overwrite:
            raise ApiError(400, f"{path.uri} exists; save under another name or with overwrite", param="path")
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
        tmp.mkdir()
        try:
            fill(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def write_run(self, run: str, meta: dict) -> None:
        d = self.root / check_name(run, "model_id")
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{RUN_META}.{uuid.uuid4().hex}.tmp"
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, d / RUN_META)

    def read_run(self, run: str) -> dict:
        f = self.root / check_name(run, "run_id") / RUN_META
        if not f.is_file():
            raise ApiError(404, f"no training run {run[:80]}", param="run_id", code="run_not_found")
        return json.loads(f.read_text())
