"""The RLHF pipeline's plumbing on the tiny model (a smoke test: learning is measured on a real
model): `rlhf make-prefs` labels the policy's samples with a judge (best against worst),
`rlhf train-rm` learns a reward model from those pairs, and PPO with a critic trains against the
learned reward (`reward.type: model`, normalised) while the held-out eval scores the gold judge
(`reward.eval_rules`)."""

import contextlib
import io
import json
from pathlib import Path

from services.cli import main
from services.common.config import load_config
from services.local import run_local

ROOT = Path(__file__).resolve().parents[2]
JUDGE = [{"name": "exact_match"}, {"name": "edit_distance"}]


def _cli(*args) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(list(args)) == 0
    return out.getvalue()


def test_prefs_then_reward_model_then_ppo_against_it(tiny_model_dir, tmp_path):
    config = tmp_path / "rlhf.yaml"
    config.write_text(
        json.dumps(
            {
                "model": {"path": tiny_model_dir, "device": "cpu"},
                "prompt_length": 16,
                "response_length": 8,
                "data": {"train": "synthetic:reverse", "eval": "synthetic:reverse", "eval_size": 16},
                "reward": {"rules": JUDGE},
                "reward_model": {
                    "train": str(tmp_path / "pairs.jsonl"),
                    "eval_fraction": 0.2,
                    "epochs": 2,
                    "batch_size": 16,
                    "micro_batch_size": 8,
                    "lr": 1e-3,
                    "head_lr": 1e-2,
                    "out": str(tmp_path / "rm"),
                },
            }
        )
    )
    printed = _cli("make-prefs", "-c", str(config), "--out", str(tmp_path / "pairs.jsonl"), "--limit", "160")
    pairs = [json.loads(x) for x in (tmp_path / "pairs.jsonl").read_text().splitlines()]
    assert f"{len(pairs)} pairs written to" in printed and len(pairs) > 100
    assert all(p["chosen_reward"] > p["rejected_reward"] for p in pairs)
    _cli("train-rm", "-c", str(config))
    stats = json.loads((tmp_path / "rm" / "reward_stats.json").read_text())
    assert stats["held_out_accuracy"] > 0.5, stats  # better than a coin at telling the judge's pairs apart
    cfg = load_config(
        ROOT / "configs" / "tiny-cpu.yaml",
        [
            f"model.path={tiny_model_dir}",
            "adv_estimator=gae",
            "run.iterations=2",
            "run.eval_interval=1",
            "rollout_batch_size=16",
            "data.eval_size=16",
            "reward.type=model",
            f"reward.model_path={tmp_path / 'rm'}",
            "reward.model_normalize=true",
            f"reward.eval_rules={json.dumps(JUDGE)}",
        ],
    )
    summary = run_local(cfg, tmp_path / "run")
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["iterations"] == 2 and "critic/explained_variance" in rows[1]
    assert "eval/exact_match" in rows[1] and "eval/edit_distance" in rows[1]  # the gold judge's, held out
    # the same held-out responses scored by the proxy too: the learned reward model, normalised
    gens = [json.loads(x) for x in (tmp_path / "run" / "generations" / "iter_000001.jsonl").read_text().splitlines()]
    assert len(gens) == 16 and all("proxy_reward" in g for g in gens)
    assert abs(sum(g["proxy_reward"] for g in gens) / 16 - rows[1]["eval/proxy_reward_mean"]) < 1e-6
