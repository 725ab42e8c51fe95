"""Synchronous distributed PPO (`rlhf up`, max_staleness=0) runs the same step code on the same
data in the same order as the in-process trainer; with the same seed it samples the same
responses, so the two runs' per-iteration numbers agree, not just their trends. What `rlhf up`
prints is the README's sample of `make run`, line for line, its varying digits aside."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("reward/score_mean", "ppo/pg_loss", "ppo/kl_ref", "critic/vf_loss", "eval/reward_mean")


def test_synchronous_distributed_run_matches_the_in_process_trainer(tiny_model_dir, tmp_path):
    config = tmp_path / "cfg.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "rollout_batch_size": 16,
                "prompt_length": 16,
                "response_length": 8,
                "adv_estimator": "gae",
                "ppo_epochs": 2,
                "ppo_mini_batch_size": 8,
                "actor_lr": 2e-4,
                "max_staleness": 0,
                "model": {"path": tiny_model_dir, "device": "cpu"},
                "critic": {"lr": 1e-3},
                "data": {"eval_size": 32},
                "rollout": {"prompts_per_request": 16},
                "run": {"iterations": 4, "eval_interval": 2, "checkpoint_interval": 0, "seed": 3},
            }
        )
    )
    rows = {}
    for mode, cmd in (("local", ["train", "--local"]), ("up", ["up"])):
        run_dir = tmp_path / mode
        proc = subprocess.run(
            [sys.executable, "-m", "services.cli", *cmd, "-c", str(config), "--run-dir", str(run_dir)],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        if mode == "up":
            _prints_as_the_readme_shows(proc.stdout, run_dir, iterations=4)
        rows[mode] = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows["up"]] == [r["iteration"] for r in rows["local"]] == [0, 1, 2, 3, 4]
    compared = 0
    for a, b in zip(rows["local"], rows["up"]):
        for k in KEYS:
            if k in a:
                assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), (a["iteration"], k)
                compared += 1
    assert compared >= 15


def _readme_sample() -> list[str]:
    """The README's sample output of `make run` (the block that starts with the Redis line)."""
    text = (ROOT / "README.md").read_text()
    start = text.index("```\nembedded Redis on") + 4
    return text[start : text.index("```", start)].splitlines()


def _shape(line: str, run_dir: Path, iterations: int) -> re.Pattern:
    """A README line as a pattern: its run directory this run's, its iteration count this run's,
    and every number (or `..` of varying digits) any number."""
    line = line.replace("runs/tiny-cpu", "\0RUN").replace("/200", "/\0N")
    line = line.replace("in 200 iterations", "in \0N iterations")
    pattern = ""
    for piece in re.split(r"(\0RUN|\0N|[0-9.]*[0-9][0-9.]*|\.\.+|\s+)", line):
        if piece == "\0RUN":
            pattern += re.escape(str(run_dir))
        elif piece == "\0N":
            pattern += str(iterations)
        elif piece and (piece[0].isdigit() or piece.startswith("..") or re.fullmatch(r"[0-9.]+", piece)):
            pattern += r"-?[0-9.]+"
        elif piece and piece.isspace():
            pattern += r"\s+"
        else:
            pattern += re.escape(piece)
    return re.compile(pattern)


def _prints_as_the_readme_shows(stdout: str, run_dir: Path, iterations: int) -> None:
    """Every line of the README's sample (but its `...`) is a line `rlhf up` printed, and every
    line it printed is one of the sample's."""
    shapes = [(line, _shape(line, run_dir, iterations)) for line in _readme_sample() if line != "..."]
    printed = [line for line in stdout.splitlines() if line.strip()]
    for line, shape in shapes:
        assert any(shape.fullmatch(p) for p in printed), (line, shape.pattern, printed)
    for p in printed:
        assert any(shape.fullmatch(p) for _, shape in shapes), (p, printed)
