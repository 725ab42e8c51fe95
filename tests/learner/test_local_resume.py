"""`rlhf train --local` goes on from its checkpoint: stopped (here: its iterations raised after it
finished) and started again, its metrics rows continue; `run.resume_from` picks a checkpoint."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _train(tiny_model_dir, run_dir, iterations, *sets):
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "train",
        "--local",
        "-c",
        str(ROOT / "configs" / "tiny-cpu.yaml"),
        "--run-dir",
        str(run_dir),
        "--set",
        f"model.path={tiny_model_dir}",
        "--set",
        f"run.iterations={iterations}",
        "--set",
        "run.checkpoint_interval=2",
        "--set",
        "run.eval_interval=2",
        "--set",
        "rollout_batch_size=8",
        "--set",
        "ppo_mini_batch_size=8",
        "--set",
        "data.eval_size=4",
    ]
    for s in sets:
        cmd += ["--set", s]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _rows(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_train_local_goes_on_from_its_checkpoint(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    _train(tiny_model_dir, run, 3)
    first = _rows(run)
    assert [r["iteration"] for r in first] == [0, 1, 2, 3]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter_000002", "iter_000003"]
    _the_format_reads_the_local_checkpoint(run)
    again = _train(tiny_model_dir, run, 5)
    assert "resumed from" in again.stderr and "iter_000003 (iteration 3)" in again.stderr
    rows = _rows(run)
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert rows[:4] == first  # the first run's rows kept as they were, not rewritten
    assert [r["policy/version"] for r in rows[1:]] == [1, 2, 3, 4, 5]  # the learner went on, not over
    summary = json.loads((run / "summary.json").read_text())
    assert summary["iterations"] == 5 and summary["baseline_eval_reward"] == first[0]["eval/reward_mean"]
    # finished: the same command again trains nothing
    done = _train(tiny_model_dir, run, 5)
    assert "already finished" in done.stderr and _rows(run) == rows


def test_resume_from_a_chosen_checkpoint(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    _train(tiny_model_dir, run, 4)
    branch = tmp_path / "branch"
    r = _train(tiny_model_dir, branch, 4, f"run.resume_from={run / 'checkpoints' / 'iter_000002'}")
    assert "iter_000002 (iteration 2)" in r.stderr
    assert [row["iteration"] for row in _rows(branch)] == [3, 4]
    assert [row["policy/version"] for row in _rows(branch)] == [3, 4]


def test_a_branch_keeps_the_reference_it_is_told(tiny_model_dir, tmp_path):
    """A run started from an earlier run's final/ takes model.reference_path as its KL reference:
    the reference's weights are those of that model, not the new starting policy's."""
    import torch

    from services.common.config import config_from_dict
    from services.learner.trainer import PolicyTrainer

    run = tmp_path / "run"
    _train(tiny_model_dir, run, 2, "actor_lr=1e-3")
    final = str(run / "final")
    base = {"use_kl_loss": True, "run": {"seed": 0}}
    moved = PolicyTrainer(config_from_dict({**base, "model": {"path": final, "device": "cpu"}}))
    kept = PolicyTrainer(
        config_from_dict({**base, "model": {"path": final, "device": "cpu", "reference_path": tiny_model_dir}})
    )
    sft = PolicyTrainer(config_from_dict({**base, "model": {"path": tiny_model_dir, "device": "cpu"}}))
    name, w = next((n, p) for n, p in sft.ref.named_parameters() if p.ndim == 2)
    assert torch.equal(dict(kept.ref.named_parameters())[name], w)  # the SFT model, as told
    assert not torch.equal(dict(moved.ref.named_parameters())[name], w)  # unset: it moved with the policy
    assert torch.equal(dict(kept.policy.named_parameters())[name], dict(moved.policy.named_parameters())[name])


def test_saved_model_files_are_readable_as_the_umask_allows(tiny_model_dir, tmp_path):
    """final/model.safetensors was written 0600 (safetensors' temporary file): other users, and
    containers running as another uid, could not read the run's policy."""
    import stat

    from services.common.config import config_from_dict
    from services.learner.trainer import PolicyTrainer

    old = os.umask(0o022)
    try:
        trainer = PolicyTrainer(config_from_dict({"model": {"path": tiny_model_dir, "device": "cpu"}}))
        trainer.save_policy(tmp_path / "p")
    finally:
        os.umask(old)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in (tmp_path / "p").iterdir()}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}, modes


def _the_format_reads_the_local_checkpoint(run):
    """services/common/checkpoints.py on the files `train --local` wrote: the newest checkpoint
    is the last iteration's, written by the local mode, and the policy in its learner.pt is the
    Hugging Face model beside it and final/."""
    import torch
    from safetensors.torch import load_file

    from services.common.checkpoints import Mode, complete_checkpoints, mode, newest_checkpoint, policy_weights

    ckpt = newest_checkpoint(run)
    assert [p.name for p in complete_checkpoints(run)] == ["iter_000002", "iter_000003"] and ckpt.name == "iter_000003"
    assert mode(ckpt) is Mode.LOCAL
    weights = policy_weights(ckpt)
    for hf in (load_file(str(ckpt / "model.safetensors")), load_file(str(run / "final" / "model.safetensors"))):
        assert hf and all(torch.equal(weights[k], v) for k, v in hf.items())
