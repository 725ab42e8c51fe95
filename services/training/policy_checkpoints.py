"""The training loop's own checkpoints (`PolicyCheckpoints`, when its caller has none of its
own): the policy as a Hugging Face directory under checkpoints/, and beside it whatever else a
resumable run keeps."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..common.checkpoints import checkpoint_dir, checkpoints_root
from .schedule import Tick

if TYPE_CHECKING:
    from ..common.config import Config


class PolicyCheckpoints:
    """The policy alone, as a Hugging Face directory under checkpoints/ (the last one is
    `final/`); the newest run.keep_checkpoints are kept. With `keep_state` (a resumable run),
    the last iteration is checkpointed too: a later run with more iterations goes on from it;
    `keep_state(dir, loop_state())` writes what else it needs beside the policy."""

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        learner,
        tokenizer,
        keep_state: Callable[[Path, dict], None] | None,
        loop_state: Callable[[], dict],
    ):
        self.cfg, self.run_dir, self.learner, self.tokenizer = cfg, run_dir, learner, tokenizer
        self.keep_state, self.loop_state = keep_state, loop_state

    def __call__(self, iteration: int, tick: Tick) -> None:
        if not tick.last or self.keep_state is not None:
            root, path = checkpoints_root(self.run_dir), checkpoint_dir(self.run_dir, iteration)
            self.learner.save_policy(path, self.tokenizer)
            if self.keep_state is not None:
                self.keep_state(path, self.loop_state())
            for old in sorted(root.glob("iter_*"))[: -self.cfg.run.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
