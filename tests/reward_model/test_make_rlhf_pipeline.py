"""`make run-smollm2-rlhf` as a user runs it on a fresh checkout, its three steps end to end
(make-prefs -> train-rm -> `rlhf up` with PPO and a critic against the learned reward), on the
tiny model instead of SmolLM2: the Makefile's own recipe, with its config's keys that the tiny
model cannot take overridden through $RLHF_SET. It failed at its first step once (make-prefs
refused the config for the reward model that its second step makes)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "data.train=synthetic:reverse",
    "data.eval=synthetic:reverse",
    "data.chat_template=false",
    "data.eval_size=16",
    "prompt_length=16",
    "response_length=8",
    "reward.eval_rules=[{name: exact_match}]",
    "rollout_batch_size=16",
    "ppo_mini_batch_size=16",
    "micro_batch_size=8",
    "rollout.prompts_per_request=16",
    "reward_model.epochs=1",
    "run.iterations=2",
    "run.eval_interval=2",
    "run.checkpoint_interval=0",
]


def test_make_run_smollm2_rlhf_runs_its_three_steps(tiny_model_dir, tmp_path):
    venv = Path(sys.prefix)
    out = tmp_path / "rlhf"
    env = {**os.environ, "RLHF_SET": " ".join(f"'{s}'" for s in [f"model.path={tiny_model_dir}", *TINY])}
    cmd = [
        "make",
        "--no-print-directory",
        "-o",
        f"{venv}/bin/.installed",  # the venv the tests run in, as it is
        "run-smollm2-rlhf",
        f"VENV={venv}",
        f"SMOLLM2_DIR={tiny_model_dir}",
        f"RLHF_DIR={out}",
        "RLHF_PROMPTS=64",
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    pairs = [json.loads(x) for x in (out / "pairs.jsonl").read_text().splitlines()]
    assert pairs and all(p["chosen_reward"] > p["rejected_reward"] for p in pairs)
    assert "judged by reward.eval_rules" in done.stdout
    stats = json.loads((out / "reward-model" / "reward_stats.json").read_text())
    assert 0 <= stats["held_out_accuracy"] <= 1
    summary = json.loads((out / "ppo" / "summary.json").read_text())
    assert summary["iterations"] == 2
    rows = [json.loads(x) for x in (out / "ppo" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert "eval/exact_match" in rows[-1] and "eval/proxy_reward_mean" in rows[-1]  # gold held out, proxy beside
    assert "critic/explained_variance" in rows[-1]  # PPO with a critic
