"""The learner's and the critic's steps at a config's sizes, on random weights of a real model's
shape: seconds, tokens/s and peak memory, with no weights to download.

One rollout of `rollout_batch_size` sequences, every prompt `prompt_length` and every response
`response_length` tokens long (the worst case the config allows), random tokens and rewards; then,
as one GAE iteration does: the critic's values, and the learner's step (old and reference
log-probs, the PPO update with its mini-batches and micro-batches, the critic's update). Run twice:
the first includes the warm-up (CUDA context, kernels), the second is the figure to read.

    python benchmarks/bench_steps.py -c configs/gpu.yaml --shape qwen2.5-0.5b --device cuda
    python benchmarks/bench_steps.py -c configs/gpu.yaml --shape tiny --device cpu --set rollout_batch_size=8

Prints one line per run and writes the rows as JSON with `--out`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

# Model shapes by name: the config of the architecture, weights random (seeded).
SHAPES = {
    # Qwen2.5-0.5B-Instruct's config.json (494M parameters, tied embeddings)
    "qwen2.5-0.5b": dict(
        arch="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    # SmolLM2-135M's shape (a Llama)
    "smollm2-135m": dict(
        arch="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    # a smoke test of this script
    "tiny": dict(
        arch="llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
}


def build_model(shape: str, path: Path) -> int:
    """Random weights of `shape` saved (bf16) as a model directory at `path`; the parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    spec = dict(SHAPES[shape])
    arch = spec.pop("arch")
    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[arch]
    torch.manual_seed(0)
    config = config_cls(**spec, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = model_cls(config).to(torch.bfloat16)
    model.save_pretrained(str(path))
    return sum(p.numel() for p in model.parameters())


def one_iteration(learner, critic, cfg, vocab: int, seed: int) -> dict:
    """The critic's values and the learner's step (critic update included) on a random rollout."""
    import torch

    from services.common.token_batch import build_token_batch
    from services.common.types import Rollout

    batch, prompt, response = cfg.rollout_batch_size, cfg.prompt_length, cfg.response_length
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab, (batch, prompt), generator=g).tolist()
    responses = torch.randint(3, vocab, (batch, response), generator=g).tolist()
    # the sampler's log-probs: random, about those of a random model (rollout_is reads them)
    gen_log_probs = (-torch.rand(batch, response, generator=g) * 2 - 11).tolist()
    rollout = Rollout(
        prompts,
        responses,
        torch.rand(batch, generator=g).tolist(),
        list(range(batch)),
        gen_log_probs,
        None,
        [0] * batch,
    )
    cuda = torch.cuda.is_available() and learner.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    values = critic.values(build_token_batch(prompts, responses, 0))
    rollout.values = [v.tolist() for v in values]
    if cuda:
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    metrics = learner.step(rollout, critic)
    if cuda:
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    tokens = batch * (prompt + response)
    return {
        "values_s": t1 - t0,
        "step_s": t2 - t1,
        "tokens": tokens,
        "tokens_per_s": tokens / (t2 - t0),
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "pg_loss": metrics.get("ppo/pg_loss"),
        "vf_loss": metrics.get("critic/vf_loss"),
        "grad_norm": metrics.get("ppo/grad_norm"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--config", default="configs/gpu.yaml")
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override")
    ap.add_argument("--out")
    args = ap.parse_args()

    import torch

    from services.common.config import load_config
    from services.critic.critic import Critic
    from services.learner.trainer import PolicyTrainer

    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        params = build_model(args.shape, Path(tmp) / "model")
        print(
            f"{args.shape}: {params / 1e6:.0f}M parameters, random weights built in {time.perf_counter() - t:.0f} s",
            flush=True,
        )
        cfg = load_config(args.config, overrides=[f"model.path={tmp}/model", f"model.device={args.device}", *args.set])
        t = time.perf_counter()
        learner = PolicyTrainer(cfg)
        critic = Critic.from_config(cfg)
        print(
            f"learner and critic loaded in {time.perf_counter() - t:.0f} s on {learner.device} "
            f"(bf16 {cfg.model.bf16}, gradient checkpointing {cfg.model.gradient_checkpointing})",
            flush=True,
        )
        if learner.device.type == "cuda":
            print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
        rows = []
        for run in range(args.runs):
            row = {
                "run": run,
                "shape": args.shape,
                "config": args.config,
                "device": str(learner.device),
                "rollout_batch_size": cfg.rollout_batch_size,
                "prompt_length": cfg.prompt_length,
                "response_length": cfg.response_length,
                "ppo_mini_batch_size": cfg.ppo_mini_batch_size,
                "micro_batch_size": cfg.micro_batch_size,
                **one_iteration(learner, critic, cfg, SHAPES[args.shape]["vocab_size"], seed=run),
            }
            rows.append(row)
            peak = f", peak GPU memory {row['peak_gpu_gib']:.1f} GiB" if row["peak_gpu_gib"] is not None else ""
            print(
                f"run {run}: critic values {row['values_s']:.1f} s, learner step (critic update included) "
                f"{row['step_s']:.1f} s, {row['tokens_per_s']:.0f} tokens/s{peak}; "
                f"pg_loss {row['pg_loss']:.4f}, vf_loss {row['vf_loss']:.4f}",
                flush=True,
            )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
