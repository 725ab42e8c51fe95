"""Checkpoints and the ledger of trained prompts.

A checkpoint (its format: services/common/checkpoints.py) is `run_dir/checkpoints/iter_N/` with
`learner.pt` (the learner's state: actor,
optimiser, scheduler, KL controller, reward statistics, RNG, the feeder's position, counters,
and the trajectories its updates include) and `critic/` (written by the critic server; shared
disk). It is written under a temporary name and renamed, so a crash leaves no half checkpoint.
Only then are its trajectories acknowledged in Redis and their prompt ids recorded as trained,
in one transaction, and appended to `run_dir/trained.jsonl` (once: loading a checkpoint appends
its line when a crash came between the rename and the append). The newest `keep` are kept.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from ..common.checkpoints import (
    CRITIC_DIR,
    checkpoint_dir,
    checkpoint_iteration,
    checkpoints_root,
    complete_checkpoints,
    read_state,
    write_state,
)

log = logging.getLogger(__name__)


class Checkpointer:
    def __init__(self, run_dir: Path, store, critic=None, keep: int = 2):
        self.run_dir, self.store, self.critic, self.keep = Path(run_dir), store, critic, keep
        self.root = checkpoints_root(self.run_dir)

    def critic_path(self, checkpoint: Path) -> str:
        """Where the critic server writes a checkpoint's critic: relative to the run directory,
        which is the critic server's checkpoint root (shared disk)."""
        return str((checkpoint / CRITIC_DIR).relative_to(self.run_dir))

    def complete(self) -> list[Path]:
        """Checkpoints that were fully written, oldest first."""
        return complete_checkpoints(self.run_dir)

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1] if done else None

    def save(self, iteration: int, state: dict, uncommitted: list[tuple], write_actor=None) -> Path:
        """Write `state` (plus the critic, and `write_actor(dir)`'s sharded actor in `actor/`) for
        `iteration`, then acknowledge `uncommitted`."""
        final = checkpoint_dir(self.run_dir, iteration)
        tmp = self.root / f".tmp_iter_{iteration:06d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if self.critic is not None:
            self.critic.save(self.critic_path(final))
        if write_actor is not None:
            write_actor(tmp / "actor")
        commit = [(e.decode() if isinstance(e, bytes) else e, u) for e, u in uncommitted]
        write_state(tmp, {**state, "commit": commit})
        if final.exists():  # the critic server created it
            for f in tmp.iterdir():
                os.replace(f, final / f.name)
            tmp.rmdir()
        else:
            tmp.rename(final)
        self.store.commit(commit)
        self._record(iteration, commit)
        for old in self.complete()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint %s written; trained trajectories acknowledged", final.name)
        return final

    def _record(self, iteration: int, commit: list[tuple]) -> None:
        """Append the checkpoint's prompt ids to the ledger, once: a crash between the checkpoint's
        rename and this append is mended when the checkpoint is loaded."""
        if not commit:
            return
        ledger = self.run_dir / "trained.jsonl"
        text = ledger.read_text() if ledger.exists() else ""
        if text and not text.endswith("\n"):  # a crash cut the last line short: it is rewritten
            text = text[: text.rfind("\n") + 1]
            ledger.write_text(text)
        if any(json.loads(line)["iteration"] == iteration for line in text.splitlines() if line.strip()):
            return
        with ledger.open("a") as f:
            f.write(json.dumps({"iteration": iteration, "uids": [u for _, u in commit]}) + "\n")

    def load(self, path: Path) -> dict:
        """The learner state saved in `path`; loads the critic's too, and acknowledges the
        checkpoint's trajectories in case the crash came between writing it and committing."""
        state = read_state(path)
        commit = [(e, u) for e, u in state["commit"]]
        self.store.commit(commit)
        iteration = checkpoint_iteration(path)
        if iteration is not None:
            self._record(iteration, commit)
        if self.critic is not None and (path / CRITIC_DIR).exists():
            self.critic.load(self.critic_path(path))
        return state


def finished_run(run_dir: str | Path, iterations: int) -> dict | None:
    """The summary.json of `run_dir` (as a dict) when that run already finished `iterations`
    iterations: its newest complete checkpoint, or the summary's own `iterations`, reached them, or
    it stopped on purpose (`halted`: run.on_gold_drop). None when it did not (no summary, an
    unreadable one, or fewer iterations: it continues)."""
    run_dir = Path(run_dir)
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict):
        return None
    if summary.get("halted"):  # stopped on purpose (run.on_gold_drop): finished before its iterations
        return summary
    reached = [checkpoint_iteration(p) for p in complete_checkpoints(run_dir)]
    reached.append(summary.get("iterations"))
    return summary if max((i for i in reached if isinstance(i, int)), default=0) >= iterations else None
