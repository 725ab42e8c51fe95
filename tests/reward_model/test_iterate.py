"""`rlhf iterate` on the tiny model (plumbing; learning is measured on SmolLM2 in
docs/iterated-rlhf.md): two rounds of (pairs from the round's policy -> the reward model continued
on old + new pairs -> PPO resumed from the round's policy against it), the critic reset between
them, the probe of the final policy, every round's artefacts where the docs say, the judge's labels
counted; the same command again redoes nothing."""

import contextlib
import io
import json
from pathlib import Path

import pytest

from services.cli import main

ROOT = Path(__file__).resolve().parents[2]
JUDGE = [{"name": "exact_match"}, {"name": "edit_distance"}]


def _cli(*args) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(args))
    return code, out.getvalue()


@pytest.fixture(scope="module")
def iterated(tiny_model_dir, tmp_path_factory):
    """`rlhf iterate --local` run once: (run dir, what it printed, its config)."""
    root = tmp_path_factory.mktemp("iterate")
    config = root / "iterate.yaml"
    config.write_text(
        json.dumps(
            {
                "base": str(ROOT / "configs" / "tiny-cpu.yaml"),
                "model": {"path": tiny_model_dir, "device": "cpu"},
                "rollout_batch_size": 16,
                "ppo_mini_batch_size": 16,
                "data": {"eval_size": 16},
                "reward": {
                    "type": "model",
                    "model_path": str(root / "unused"),
                    "model_normalize": True,
                    "eval_rules": JUDGE,
                },
                "reward_model": {
                    "eval_fraction": 0.2,
                    "batch_size": 16,
                    "micro_batch_size": 8,
                    "lr": 1e-3,
                    "head_lr": 1e-2,
                },
                "iterate": {
                    "rounds": 2,
                    "iterations_per_round": 1,
                    "prompts_per_round": 40,
                    "probe_prompts": 16,
                    "samples_per_prompt": 4,
                    "more": 0,
                    "hard_negatives": 0,
                    "max_pairs_per_prompt": 4,
                    "critic": "reset",
                },
                "run": {"eval_interval": 1, "checkpoint_interval": 1},
            }
        )
    )
    code, printed = _cli("iterate", "-c", str(config), "--run-dir", str(root / "run"), "--local")
    assert code == 0, printed
    return root / "run", printed, config


def test_each_round_leaves_its_pairs_reward_model_and_policy(iterated):
    run, printed, _ = iterated
    for r in (0, 1):
        d = run / f"round-{r}"
        for name in ("pairs.jsonl", "pairs-train.jsonl", "pairs-held-out.jsonl", "rm-train.jsonl"):
            assert (d / name).stat().st_size > 0, name
        assert (d / "reward-model" / "reward_stats.json").exists()
        assert (d / "policy" / "config.json").exists()
    assert (run / "probe" / "pairs.jsonl").stat().st_size > 0
    assert "== round 2 of 2 ==" in printed and "iterated RLHF: 2 rounds, 2 PPO iterations" in printed


def test_round_two_learns_on_the_policys_own_pairs_from_round_ones_reward_model(iterated):
    run, printed, _ = iterated
    index = json.loads((run / "iterate.json").read_text())
    r0, r1 = index["rounds"]
    assert r0["pairs"]["policy"] != r1["pairs"]["policy"] == str(run / "round-0" / "policy")
    assert r1["reward_model"]["base"] == str(run / "round-0" / "reward-model")  # continued, not fresh
    lines = lambda name: (run / "round-1" / name).read_text().splitlines()  # noqa: E731
    assert len(lines("rm-train.jsonl")) == len(lines("pairs-train.jsonl")) + len(
        (run / "round-0" / "pairs-train.jsonl").read_text().splitlines()
    )
    # each round labels prompts of its own (data.train's [40 R, 40 (R + 1)), the probe the next 16)
    for span in ("training prompts 0..39 ", "training prompts 40..79 ", "training prompts 80..95 "):
        assert span in printed
    assert (
        set(r1["rm_on_held_out"]) == {"round-0", "round-1"} and 0 <= r1["previous_rm_on_policy_pairs"]["accuracy"] <= 1
    )
    # PPO resumed: one run, to iteration 1 then 2, each round's end evaluated by the gold judge
    rows = [json.loads(x) for x in (run / "ppo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows if "ppo/kl_ref" in r or "reward/score_mean" in r] == [1, 2]
    assert (r0["iterations"], r1["iterations"]) == (1, 2) and "gold" in r1
    assert (run / "round-1" / "critic").is_dir()  # iterate.critic reset: round 1's critic set aside


def test_the_judges_labels_are_counted(iterated):
    run, printed, _ = iterated
    index = json.loads((run / "iterate.json").read_text())
    for e in index["rounds"]:
        sampled = 40 * 4  # prompts_per_round x samples_per_prompt, no counterfactuals
        assert e["pairs"]["judge_labels"] == e["pairs"]["samples"] + e["pairs"]["counterfactuals"] == sampled
    s = index["summary"]
    assert s["judge_labels"] == 2 * 160 and s["probe_judge_labels"] == 16 * 4
    assert f"{s['judge_labels']} judge labels" in printed
    assert s["final_rm_on_final_policy"]["pairs"] > 0


def test_the_same_command_again_redoes_nothing(iterated):
    run, _, config = iterated
    before = {p: p.stat().st_mtime_ns for p in run.rglob("pairs*.jsonl")}
    code, printed = _cli("iterate", "-c", str(config), "--run-dir", str(run), "--local")
    assert code == 0, printed
    assert {p: p.stat().st_mtime_ns for p in run.rglob("pairs*.jsonl")} == before
    assert "reward model of round" not in printed and "PPO to iteration" not in printed


def test_a_config_it_cannot_run_is_refused_with_a_sentence(tiny_model_dir, tmp_path, capsys):
    config = tmp_path / "rules.yaml"
    config.write_text(json.dumps({"base": str(ROOT / "configs" / "tiny-cpu.yaml"), "model": {"path": tiny_model_dir}}))
    assert main(["iterate", "-c", str(config), "--run-dir", str(tmp_path / "run")]) != 0
    assert "reward.type: model" in capsys.readouterr().err
