"""The in-process trainer end to end on the tiny model: every option trains, and a run leaves its
results. That an update learns is asserted on a fixed batch, where the arithmetic guarantees it
(tests/learner/test_learning_guarantees.py), not on one run's chaotic trajectory."""

import json
import math
from pathlib import Path

import pytest

from services.common.config import load_config
from services.local import run_local

ROOT = Path(__file__).resolve().parents[2]


def _cfg(model_dir, *overrides):
    return load_config(ROOT / "configs" / "tiny-cpu.yaml", [f"model.path={model_dir}", *overrides])


def test_run_directory_contents(tiny_model_dir, tmp_path):
    cfg = _cfg(tiny_model_dir, "run.iterations=4", "run.eval_interval=2", "rollout_batch_size=16")
    summary = run_local(cfg, tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r["iteration"] for r in rows if "eval/reward_mean" in r] == [0, 2, 4]
    for r in rows[1:]:
        for key in (
            "reward/score_mean",
            "ppo/kl_ref",
            "ppo/pg_clipfrac",
            "ppo/entropy",
            "critic/vf_loss",
            "rollout/tokens_per_s",
            "policy/version",
        ):
            assert key in r and math.isfinite(r[key]), key
    assert rows[-1]["policy/version"] == 4
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved == summary
    assert set(saved) >= {"baseline_eval_reward", "final_eval_reward", "iterations", "wall_s"}
    assert saved["iterations"] == 4 and saved["final_eval_reward"] == rows[-1]["eval/reward_mean"]
    png = (tmp_path / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert (tmp_path / "final" / "config.json").exists()
    assert (tmp_path / "final_critic" / "value_head.safetensors").exists()


@pytest.mark.parametrize(
    "overrides",
    [
        ["add_token_level_kl=true", "target_kl=0.05", "kl_penalty=low_var_kl"],
        ["kl_penalty=full", "use_kl_loss=true", "ref_model=mixture"],
        ["ref_model=policy", "kl_penalty=mse"],
        ["ptx_coef=0.5", "entropy_coef=0.01", "dual_clip_loss=false", "pg_clip_high=0.28"],
        ["model.lora.rank=4", "model.lora.target_modules=[q_proj, v_proj]", "actor_lr=1e-3"],
        ["model.gradient_checkpointing=true", "micro_batch_size=8", "lr_scheduler=cosine", "lr_warmup_steps=2"],
        ["reward_norm=group", "num_return_sequences_in_group=2", "adv_estimator=rloo", "reward_clip=1.0"],
        [
            "reward_norm=running",
            "reward_shift=true",
            "value_clip=0.2",
            "adv_estimator=reinforce_plus_plus",
            "recompute_old_log_probs=false",
            "loss_agg_mode=seq-mean-token-sum-norm",
        ],
        ["model.bf16=true", "loss_agg_mode=token-mean"],
    ],
)
def test_every_option_trains(tiny_model_dir, tmp_path, overrides):
    cfg = _cfg(tiny_model_dir, "run.iterations=2", "run.eval_interval=0", "rollout_batch_size=16", *overrides)
    summary = run_local(cfg, tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][1:]
    for r in rows:
        assert r["ppo/pg_loss"] is not None and math.isfinite(r["ppo/pg_loss"])
    if "ref_model=policy" in overrides:
        assert all(r["ppo/kl_ref"] == 0 for r in rows)
    if "target_kl=0.05" in overrides:
        assert rows[-1]["ppo/kl_coef"] != 0.2
    if "ptx_coef=0.5" in overrides:
        assert all(r["ppo/ptx_loss"] > 0 for r in rows)
    assert summary["iterations"] == 2


def test_a_batch_crossing_an_epoch_is_labelled_per_record(tiny_model_dir, tmp_path, monkeypatch):
    """Prompt uids are "<epoch>:<id>" with the epoch each record was drawn in: a batch larger than
    the dataset carries a prompt twice, under two uids (GRPO must not merge their groups)."""
    import services.training.sampling as sampling

    data = tmp_path / "three.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "prompt": f"{s}=", "label": s[::-1]}) + "\n"
            for i, s in enumerate(["abc", "bcd", "cde"])
        )
    )
    seen = []
    real = sampling.sample_groups

    def spy(records, uids, *a, **kw):
        if not uids[0].startswith("eval/"):  # the held-out eval samples through the same seam
            seen.append(list(uids))
        return real(records, uids, *a, **kw)

    monkeypatch.setattr(sampling, "sample_groups", spy)
    cfg = _cfg(
        tiny_model_dir,
        "run.iterations=2",
        "run.eval_interval=0",
        "rollout_batch_size=4",
        "adv_estimator=grpo",
        "num_return_sequences_in_group=2",
        f"data.train={data}",
        f"data.eval={data}",
    )
    run_local(cfg, tmp_path / "run")
    first, second = seen
    assert len(set(first)) == 4  # one prompt twice, in two epochs
    assert sorted(u.split(":")[0] for u in first) == ["0", "0", "0", "1"]
    assert sorted(u.split(":")[0] for u in second) == ["1", "1", "2", "2"]
    assert all(u.split(":")[1] in {"p0", "p1", "p2"} for u in first + second)


def test_terminal_entropy_is_per_token(tiny_model_dir, tmp_path, capsys):
    cfg = _cfg(tiny_model_dir, "run.iterations=1", "run.eval_interval=0", "rollout_batch_size=16")
    run_local(cfg, tmp_path)
    row = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][1]
    vocab = json.loads((Path(tiny_model_dir) / "config.json").read_text())["vocab_size"]
    assert 0 < row["ppo/entropy_rollout"] <= math.log(vocab) and 0 < row["ppo/entropy"] <= math.log(vocab)
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("iter    1/")][0]
    assert float(line.split("ent ")[1].split()[0]) == pytest.approx(row["ppo/entropy_rollout"], abs=1e-3)
