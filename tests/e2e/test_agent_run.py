"""`rlhf up` with an agent (`rollout.agent`) on the tiny model, each service its own process: the
workers run a two-turn agent per sample against their own OpenAI-compatible endpoint, the
learner trains on the trajectories (the environment's turn masked out of the loss, GAE over the
policy's tokens with the critic), and the run completes with every prompt trained once."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.e2e.support import write_train_data

ITERATIONS, BATCH = 4, 4

AGENT = '''
def run(client, sample):
    """Answers, is told to try again, answers again: reward 1 when the second answer is the label."""
    messages = [{"role": "user", "content": sample.prompt}]
    first = client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "again="}]
    second = client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    return 1.0 if second.choices[0].message.content.strip() == sample.label else 0.0
'''


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("agent-run")
    (root / "agent.py").write_text(AGENT)
    write_train_data(root / "train.jsonl", 32, seed=0)
    config = root / "agent.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "rollout_batch_size": BATCH,
                "num_return_sequences_in_group": 2,
                "prompt_length": 64,
                "response_length": 48,
                "adv_estimator": "gae",
                "ppo_mini_batch_size": BATCH * 2,
                "model": {"path": tiny_model_dir, "device": "cpu"},
                "data": {"train": str(root / "train.jsonl"), "eval": "synthetic:reverse", "eval_size": 8},
                "run": {"iterations": ITERATIONS, "eval_interval": 0, "checkpoint_interval": 2, "seed": 0},
                "rollout": {"agent": f"{root / 'agent.py'}:run", "agent_timeout_s": 120, "prompts_per_request": 2},
            }
        )
    )
    run_dir = root / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "up", "-c", str(config), "--run-dir", str(run_dir), "--workers", "1"],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=Path(__file__).resolve().parents[2],
    )
    return proc, run_dir


def test_a_run_of_agent_sessions_completes_and_trains_every_prompt_once(run):
    proc, run_dir = run
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["iterations"] == ITERATIONS and summary["dead_letters"] == 0
    uids = [u for line in (run_dir / "trained.jsonl").read_text().splitlines() for u in json.loads(line)["uids"]]
    assert len(uids) == ITERATIONS * BATCH and len(set(uids)) == len(uids)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    trained = [r for r in rows if r["iteration"] >= 1]
    assert [r["iteration"] for r in trained] == list(range(1, ITERATIONS + 1))
    for r in trained:  # the PPO step ran on the sessions: finite losses, the critic trained too
        assert all(r[k] == r[k] for k in ("ppo/pg_loss", "critic/vf_loss", "ppo/kl_ref")), r
        assert r["rollout/samples"] == BATCH * 2 and r["rollout/tokens"] > 0
