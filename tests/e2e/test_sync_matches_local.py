"""Synchronous distributed PPO (`rlhf up`, max_staleness=0) runs the same step code on the same
data in the same order as the in-process trainer; with the same seed it samples the same
responses, so the two runs' per-iteration numbers agree, not just their trends."""

import json
import subprocess
import sys

import pytest
import yaml

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
        rows[mode] = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows["up"]] == [r["iteration"] for r in rows["local"]] == [0, 1, 2, 3, 4]
    compared = 0
    for a, b in zip(rows["local"], rows["up"]):
        for k in KEYS:
            if k in a:
                assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), (a["iteration"], k)
                compared += 1
    assert compared >= 15
