"""Peak memory against the rollout batch, at a fixed micro-batch: it should not grow with the
batch. Each measurement runs in a fresh process.

  - default: one learner step (old log-probs, reference, update) and one critic step (values,
    train); the peak RSS reset before the step and read after.
  - `--iteration`: a whole in-process iteration (`rlhf train --local`: generation, rewards,
    values, the learner and critic steps, the push); the process's peak RSS, loading included.

The model is a random 2-layer Llama with SmolLM2's 49,152-token vocabulary: the output layer
dominates, as at real sizes. Prompts and responses of up to 64 tokens by default.

    python benchmarks/bench_memory.py --batches 16,64,256 --out runs/bench/memory.json
    python benchmarks/bench_memory.py --iteration --batches 64,256
    PYTHONPATH=<another checkout> python benchmarks/bench_memory.py ...   (to compare code)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

VOCAB = 49152


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def build_model(path: Path, vocab: int = VOCAB) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    LlamaForCausalLM(cfg).save_pretrained(str(path))


def build_iteration_model(path: Path, vocab: int = VOCAB) -> None:
    """A random tiny policy (services/cli/tiny.py's shape) with a tokenizer padded to `vocab` tokens:
    what a whole iteration needs (prompts to tokenize, replies to decode and score)."""
    from services.cli.tiny import build_model as tiny_model
    from services.cli.tiny import build_tokenizer

    tok = build_tokenizer(vocab)
    tiny_model(len(tok)).save_pretrained(str(path))
    tok.save_pretrained(str(path))


def measure_iteration(model: str, batch: int, prompt: int, response: int, micro: int) -> dict:
    """In this process: one GAE iteration of `rlhf train --local` on `batch` prompts (one sample
    each) of the synthetic reverse task; the peak RSS of the process (MB), loading included."""
    import torch

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    from services.common.config import config_from_dict
    from services.local import run_local

    with tempfile.TemporaryDirectory() as run_dir:
        cfg = config_from_dict(
            {
                "model": {"path": model, "device": "cpu"},
                "adv_estimator": "gae",
                "rollout_batch_size": batch,
                "num_return_sequences_in_group": 1,
                "ppo_mini_batch_size": batch,
                "micro_batch_size": micro,
                "log_prob_micro_batch_size": micro,
                "prompt_length": prompt,
                "response_length": response,
                "use_kl_loss": True,
                "kl_loss_coef": 0.01,
                "reward": {"type": "rules", "rules": [{"name": "edit_distance"}]},
                "data": {"train": "synthetic:reverse", "eval": "synthetic:reverse", "eval_size": 8},
                "rollout": {"prompts_per_request": batch},
                "run": {"run_dir": run_dir, "iterations": 1, "eval_interval": 0, "checkpoint_interval": 0},
            }
        )
        summary = run_local(cfg, run_dir)
        tokens = sum(
            json.loads(line).get("rollout/tokens", 0)
            for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
        )
    return {
        "batch": batch,
        "micro_batch_size": micro,
        "prompt": prompt,
        "response": response,
        "peak_rss_mb": _rss_kib("VmHWM") / 1024,
        "rollout_tokens": tokens,
        "iterations": summary.get("iterations"),
    }


def measure(model: str, batch: int, prompt: int, response: int, micro: int, vocab: int = VOCAB) -> dict:
    """In this process: peak RSS (MB) above the resident set before one learner step and one
    critic step on a random rollout of `batch` sequences."""
    import torch

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    from services.common.config import config_from_dict
    from services.common.types import Rollout
    from services.critic.critic import Critic
    from services.learner.trainer import PolicyTrainer

    cfg = config_from_dict(
        {
            "model": {"path": model, "device": "cpu"},
            "adv_estimator": "gae",
            "rollout_batch_size": batch,
            "ppo_mini_batch_size": batch,
            "micro_batch_size": micro,
            "prompt_length": prompt,
            "response_length": response,
            "use_kl_loss": True,
            "kl_loss_coef": 0.01,
            "entropy_coef": 0.001,
            "fuse_old_log_probs": False,
        }
    )
    learner = PolicyTrainer(cfg)
    critic = Critic.from_config(cfg)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (batch, prompt), generator=g).tolist()
    responses = torch.randint(3, vocab, (batch, response), generator=g).tolist()
    rollout = Rollout(
        prompts, responses, torch.rand(batch, generator=g).tolist(), list(range(batch)), None, None, [0] * batch
    )
    from services.common.token_batch import build_token_batch

    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    before = _rss_kib("VmRSS")
    values = critic.values(build_token_batch(prompts, responses, 0))
    rollout.values = [v.tolist() for v in values]
    metrics = learner.step(rollout, critic)
    peak = _rss_kib("VmHWM")
    return {
        "batch": batch,
        "micro_batch_size": micro,
        "prompt": prompt,
        "response": response,
        "vocab": vocab,
        "rss_before_mb": before / 1024,
        "step_peak_mb": (peak - before) / 1024,
        "peak_rss_mb": peak / 1024,
        "pg_loss": metrics["ppo/pg_loss"],
        "vf_loss": metrics.get("critic/vf_loss"),
    }


def run(
    model: str, batch: int, prompt: int, response: int, micro: int, timeout: float = 1800, iteration: bool = False
) -> dict:
    """`measure` (or `measure_iteration`) in a fresh process."""
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        "--model",
        model,
        "--batches",
        str(batch),
        "--prompt",
        str(prompt),
        "--response",
        str(response),
        "--micro",
        str(micro),
    ] + (["--iteration"] if iteration else [])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [os.environ.get("PYTHONPATH"), str(Path(__file__).resolve().parents[1])])
        ),
    }
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"worker failed ({out.returncode}): {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="16,64,256")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--model", help="a model directory (default: a random big-vocabulary Llama built here)")
    ap.add_argument("--iteration", action="store_true", help="a whole in-process iteration, generation included")
    ap.add_argument("--out")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.worker:
        fn = measure_iteration if args.iteration else measure
        print(json.dumps(fn(args.model, batches[0], args.prompt, args.response, args.micro)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(Path(tmp) / "model")
        if not args.model:
            (build_iteration_model if args.iteration else build_model)(Path(model))
        rows = [run(model, b, args.prompt, args.response, args.micro, iteration=args.iteration) for b in batches]
    if args.iteration:
        base = rows[0]["peak_rss_mb"]
        print(f"{'batch':>6} {'tokens':>7} {'peak RSS MB':>12} {'x smallest':>10}")
        for r in rows:
            print(
                f"{r['batch']:>6} {r['rollout_tokens']:>7} {r['peak_rss_mb']:>12.0f} {r['peak_rss_mb'] / base:>10.2f}"
            )
    else:
        base = rows[0]["step_peak_mb"]
        print(f"{'batch':>6} {'step peak MB':>13} {'x smallest':>10} {'peak RSS MB':>12}")
        for r in rows:
            print(
                f"{r['batch']:>6} {r['step_peak_mb']:>13.0f} {r['step_peak_mb'] / base:>10.2f} "
                f"{r['peak_rss_mb']:>12.0f}"
            )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
