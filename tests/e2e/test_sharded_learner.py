"""`rlhf up` with the learner and the critic server each sharded across 2 processes (FSDP2, gloo)
on the tiny model, beside the same run with 1 process each: it learns like it. Mid-run the follower rank is killed with
SIGKILL: the learner group goes down, `rlhf up` restarts it, it resumes from its sharded
checkpoint, and every prompt is still trained exactly once."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.support import run_iterations, up_command

ROOT = Path(__file__).resolve().parents[2]
ITERATIONS, BATCH = 60, 64


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _kill_followers(run_dir: Path, service: str) -> int:
    pid = json.loads((run_dir / "services.json").read_text())["services"][service]["pid"]
    followers = _children(pid)
    for f in followers:
        os.kill(f, signal.SIGKILL)
    return len(followers)


def _wait_for(run_dir: Path, iteration: int, up, log_path: Path) -> int:
    deadline = time.time() + 900
    while run_iterations(run_dir) < iteration:
        assert up.poll() is None and time.time() < deadline, log_path.read_text()[-3000:]
        time.sleep(0.2)
    return run_iterations(run_dir)


def _up(tiny_model_dir, run_dir: Path, nproc: int, kill_follower_at: int | None = None) -> dict:
    """A run with the learner and the critic server each in `nproc` processes."""
    cmd = up_command(
        "configs/tiny-cpu.yaml",
        run_dir,
        "--set",
        f"model.path={tiny_model_dir}",
        "--set",
        f"run.iterations={ITERATIONS}",
        "--set",
        "run.checkpoint_interval=5",
        "--set",
        f"model.nproc={nproc}",
        "--set",
        f"critic.nproc={nproc}",
    )
    log_path = run_dir.parent / f"up-{nproc}.log"
    out: dict = {}
    with log_path.open("w") as log:
        up = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        if kill_follower_at is not None:  # the learner's follower, then (later) the critic's
            out["killed_at"] = _wait_for(run_dir, kill_follower_at, up, log_path)
            out["followers"] = _kill_followers(run_dir, "learner")
            _wait_for(run_dir, kill_follower_at + 15, up, log_path)
            out["critic_followers"] = _kill_followers(run_dir, "critic")
        assert up.wait(timeout=1800) == 0, log_path.read_text()[-4000:]
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            up.wait(timeout=120)
    out["log"] = log_path.read_text()
    out["summary"] = json.loads((run_dir / "summary.json").read_text())
    out["ledger"] = [u for x in (run_dir / "trained.jsonl").read_text().splitlines() for u in json.loads(x)["uids"]]
    out["learner_log"] = (run_dir / "logs" / "learner.log").read_text()
    out["critic_log"] = (run_dir / "logs" / "critic.log").read_text()
    return out


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    one = _up(tiny_model_dir, root / "one", 1)
    two = _up(tiny_model_dir, root / "two", 2, kill_follower_at=20)
    return one, two


def test_two_learner_processes_learn_like_one(runs):
    one, two = runs
    gains = [r["summary"]["final_eval_reward"] - r["summary"]["baseline_eval_reward"] for r in runs]
    assert one["summary"]["baseline_eval_reward"] == pytest.approx(two["summary"]["baseline_eval_reward"])
    print(f"held-out gain over {ITERATIONS} iterations: 1 learner process {gains[0]:+.3f}, 2 processes {gains[1]:+.3f}")
    # each run a trajectory of its own: over seeds x kernels the 60-iteration gain has mean 0.51, sd 0.10,
    # min 0.26 (benchmarks/bench_learning_spread.py), so each is held to mean - 4 sd and their difference
    # is not asserted; that two processes compute what one does is test_fsdp.py's (the same step, bit for bit)
    assert min(gains) >= 0.1, gains
    assert "rank 0 of 2 (gloo)" in two["learner_log"]
    assert "rank 0 of 2 (gloo)" in two["critic_log"]


def test_a_killed_follower_brings_the_group_back_from_the_sharded_checkpoint(runs):
    _, two = runs
    s = two["summary"]
    assert two["followers"] == 1 and two["critic_followers"] == 1
    # the critic's rank 0 found its group broken, exited, and came back from the newest checkpoint
    assert "critic exited with code 75; restarting it" in two["log"], two["log"][-3000:]
    assert "critic restored from checkpoints/iter_" in two["critic_log"]
    assert s["iterations"] == ITERATIONS
    assert s["resumed_from"] is not None and 5 <= s["resumed_from"] <= two["killed_at"], two["log"][-2000:]
    assert "learner exited with code" in two["log"] and "restarting it" in two["log"]
    assert len(two["ledger"]) == ITERATIONS * BATCH
    assert len(set(two["ledger"])) == len(two["ledger"]), "a prompt was trained on twice"
