"""Reading and scoring a trained model: `rlhf eval` writes one row per prompt (or per sample) and a
summary whose mean is the rows'; `--baseline` scores two models on the same prompts; a training
run writes each held-out eval's generations, keeps the best held-out policy in best/ (which `rlhf
eval` scores exactly as the run did) and the newest run.keep_checkpoints checkpoints."""

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from services.cli import main
from services.common.config import load_config
from services.local import run_local

ROOT = Path(__file__).resolve().parents[2]


def _eval(*args) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["eval", *args]) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory):
    """A short in-process run: an eval and a checkpoint every iteration, two checkpoints kept."""
    root = tmp_path_factory.mktemp("evalrun")
    cfg = load_config(
        ROOT / "configs" / "tiny-cpu.yaml",
        [
            f"model.path={tiny_model_dir}",
            "run.iterations=6",
            "run.eval_interval=1",
            "run.checkpoint_interval=1",
            "run.keep_checkpoints=2",
            "rollout_batch_size=16",
            "data.eval_size=32",
            "actor_lr=1e-3",
        ],
    )
    run_local(cfg, root)
    config = root / "eval.yaml"
    config.write_text(
        json.dumps(
            {
                "model": {"path": tiny_model_dir, "device": "cpu"},
                "data": {"eval": "synthetic:reverse", "eval_size": 32},
                "reward": cfg.reward.model_dump(),
                "response_length": cfg.response_length,
            }
        )
    )
    return root, config


def test_eval_writes_a_row_per_sample_and_a_summary_of_them(run, tmp_path):
    root, config = run
    printed = _eval("-c", str(config), "--out", str(tmp_path / "greedy"))
    rows = [json.loads(x) for x in (tmp_path / "greedy" / "model.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "greedy" / "summary.json").read_text())
    assert len(rows) == 32 and len({r["id"] for r in rows}) == 32 and {r["sample"] for r in rows} == {0}
    assert all(set(r) == {"id", "prompt", "response", "label", "reward", "components", "sample"} for r in rows)
    assert summary["model"]["reward_mean"] == pytest.approx(sum(r["reward"] for r in rows) / 32, abs=1e-12)
    assert "32 prompts from synthetic:reverse, 1 sample(s) each (greedy)" in printed and "reward_mean" in printed
    _eval(
        "-c",
        str(config),
        "--out",
        str(tmp_path / "n4"),
        "--n",
        "4",
        "--temperature",
        "1",
        "--limit",
        "8",
        "--rule",
        "exact_match",
        "--pass-reward",
        "1",
    )
    rows = [json.loads(x) for x in (tmp_path / "n4" / "model.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "n4" / "summary.json").read_text())["model"]
    assert len(rows) == 32 and sorted({r["sample"] for r in rows}) == [0, 1, 2, 3]
    assert summary["reward_mean"] == pytest.approx(sum(r["reward"] for r in rows) / 32, abs=1e-12)
    passed = {r["id"] for r in rows if r["reward"] >= 1}
    assert summary["pass_at_n"] == len(passed) / 8 and set(rows[0]["components"]) == {"exact_match"}


def test_baseline_and_model_on_the_same_prompts(run, untrained_model_dir, tmp_path):
    root, config = run
    printed = _eval(
        "-c", str(config), "--model", str(root / "final"), "--baseline", untrained_model_dir, "--out", str(tmp_path)
    )
    base = [json.loads(x) for x in (tmp_path / "baseline.jsonl").read_text().splitlines()]
    model = [json.loads(x) for x in (tmp_path / "model.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in base] == [r["prompt"] for r in model]
    summary = json.loads((tmp_path / "summary.json").read_text())
    c = summary["compared"]
    assert c["better"] + c["worse"] + c["same"] == 32
    change = summary["model"]["reward_mean"] - summary["baseline"]["reward_mean"]
    assert c["reward_mean_change"] == pytest.approx(change)
    assert "per sample against the baseline" in printed


def test_a_run_keeps_its_generations_its_best_policy_and_its_newest_checkpoints(run, tmp_path):
    root, config = run
    metrics = [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]
    evals = {r["iteration"]: r["eval/reward_mean"] for r in metrics if "eval/reward_mean" in r}
    assert sorted(evals) == list(range(7))
    for it, score in evals.items():
        rows = [json.loads(x) for x in (root / "generations" / f"iter_{it:06d}.jsonl").read_text().splitlines()]
        assert len(rows) == 32 and sum(r["reward"] for r in rows) / 32 == pytest.approx(score, abs=1e-12)
    # the newest two (the last iteration's too: a later run with more iterations goes on from it)
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["iter_000005", "iter_000006"]
    # a checkpoint evaluates as it is: the last one holds the final policy
    from services.generation.policy import load_policy

    final = load_policy(str(root / "final"), str(root / "final")).model.state_dict()
    last = load_policy(str(root / "checkpoints" / "iter_000006"), str(root / "final")).model.state_dict()
    assert all(torch.equal(last[k], v) for k, v in final.items())
    trained = {it: s for it, s in evals.items() if it > 0}
    if max(trained.values()) <= evals[0]:  # no iteration beat the base policy: nothing to keep
        assert not (root / "best").exists()
        return
    best = json.loads((root / "best" / "best.json").read_text())
    assert best["iteration"] == max(trained, key=lambda it: (trained[it], -it))  # the first of the best
    assert best["eval/reward_mean"] == trained[best["iteration"]] > evals[0]
    # best/ is that iteration's policy: scored again, greedy on the same prompts, it says the same
    _eval("-c", str(config), "--model", str(root / "best"), "--out", str(tmp_path))
    again = json.loads((tmp_path / "summary.json").read_text())["model"]["reward_mean"]
    assert again == pytest.approx(best["eval/reward_mean"], abs=1e-9)


def test_a_learner_checkpoint_and_a_lora_adapter_load_as_their_policies(tiny_model_dir, tmp_path):
    import torch

    from services.common.checkpoints import write_state
    from services.generation.policy import load_policy
    from services.learner.trainer import PolicyTrainer

    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml", [f"model.path={tiny_model_dir}"])
    trainer = PolicyTrainer(cfg, total_updates=1)
    with torch.no_grad():
        for p in trainer.policy.parameters():
            p.add_(0.01)  # not the base weights
    (tmp_path / "ckpt").mkdir()
    # what `rlhf up` and `train --local` checkpoints hold: the learner's state among the run's
    write_state(tmp_path / "ckpt", {"learner": trainer.state_dict(), "iteration": 1})
    loaded = load_policy(str(tmp_path / "ckpt"), tiny_model_dir).model.state_dict()
    for k, v in trainer.policy.state_dict().items():
        assert torch.equal(loaded[k], v), k
    config = tmp_path / "c.yaml"  # `rlhf export`: the same policy as a Hugging Face directory
    config.write_text(json.dumps({"model": {"path": tiny_model_dir, "device": "cpu"}}))
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["export", str(tmp_path / "ckpt"), "-c", str(config), "--out", str(tmp_path / "hf")]) == 0
    exported = load_policy(str(tmp_path / "hf"), tiny_model_dir).model.state_dict()
    for k, v in trainer.policy.state_dict().items():
        assert torch.equal(exported[k], v), k
    lora = PolicyTrainer(
        load_config(ROOT / "configs" / "tiny-cpu.yaml", [f"model.path={tiny_model_dir}", "model.lora.rank=4"]),
        total_updates=1,
    )
    with torch.no_grad():
        for n, p in lora.policy.named_parameters():
            if "lora_B" in n:
                p.add_(0.05)  # adapters that change something
    from services.common.model_files import load_tokenizer

    lora.save_policy(tmp_path / "final", load_tokenizer(tiny_model_dir))  # merged model, and adapter/ beside it
    merged = load_policy(str(tmp_path / "final"), tiny_model_dir).model.state_dict()
    from_adapter = load_policy(str(tmp_path / "final" / "adapter"), tiny_model_dir).model.state_dict()
    for k, v in merged.items():
        assert torch.allclose(from_adapter[k], v, atol=1e-6), k
    with pytest.raises(ValueError, match="PEFT wrapper"):
        (tmp_path / "lora-ckpt").mkdir()
        write_state(tmp_path / "lora-ckpt", {"learner": lora.state_dict()})
        load_policy(str(tmp_path / "lora-ckpt"), tiny_model_dir)
