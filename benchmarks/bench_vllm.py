"""Benchmark: the vLLM generation backend (run with the vLLM venv's Python).

    make bench           (writes runs/bench/vllm.json and prints a table)

Measures, in one run on one machine and the same prompts:
  - tokens/s of the vllm backend behind the gRPC server vs vLLM's own `LLM.generate` (the
    service layer's cost; goal >= 0.9x), and vs the hf backend behind the same server;
  - tokens/s of both backends on a ~100M-parameter random Llama-shaped model (16 prompts);
  - seconds of a weight swap (PushWeights end to end, and the engine's reload alone) for the tiny
    policy and for a ~100M-parameter random Llama-shaped model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch


def interleaved(fns: dict, repeats: int) -> dict:
    """Each of `fns` (name -> a call returning tokens) once to warm up, then `repeats` rounds that
    run every one in turn: tokens/s and seconds, medians over the rounds (noise hits all alike)."""
    for fn in fns.values():
        fn()
    rates: dict = {k: [] for k in fns}
    secs: dict = {k: [] for k in fns}
    tokens = {}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            tokens[k] = fn()
            dt = time.perf_counter() - t0
            secs[k].append(dt)
            rates[k].append(tokens[k] / dt)
    return {
        k: {"tokens_per_s": statistics.median(rates[k]), "seconds": statistics.median(secs[k]), "tokens": tokens[k]}
        for k in fns
    }


def server_cfg(model, backend, max_new_tokens):
    from services.common.config import config_from_dict

    return config_from_dict(
        {
            "model": {"path": str(model), "device": "cpu"},
            "prompt_length": 32,
            "response_length": max_new_tokens,
            "rpc": {"max_samples_per_prompt": 16, "generation": {"port": 0, "metrics_port": None}},
            "generation": {
                "backend": backend,
                "batch_window_ms": 1,
                "vllm": {"dtype": "float32", "enforce_eager": True, "cpu_kvcache_space_gb": 2},
            },
        }
    )


def random_llama(out: Path, tokenizer_from: str, layers: int, hidden: int) -> int:
    """A random Llama-shaped model with the tiny tokenizer; returns its parameter count."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_from)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def swap_times(model_dir: Path, repeats: int) -> dict:
    """PushWeights end to end over loopback gRPC and the engine's reload alone, in seconds."""
    from services.common.model_files import load_causal_lm
    from services.generation.client import GenerationClient
    from services.generation.server import serve

    state = load_causal_lm(model_dir).state_dict()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    cfg = server_cfg(model_dir, "vllm", 8)
    with serve(cfg) as svc:
        client = GenerationClient(f"127.0.0.1:{svc.server.port}", cfg.rpc)
        push, reload = [], []
        for v in range(1, min(repeats, 3) + 1):
            new = {k: t + 0.01 for k, t in state.items()}
            t0 = time.perf_counter()
            client.update_weights(new, v)
            push.append(time.perf_counter() - t0)
            reload.append(svc.servicer.backend.swap_seconds)
        client.close()
    return {"mb": nbytes / 1e6, "push_s": statistics.median(push), "engine_reload_s": statistics.median(reload)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="runs/tiny-model")
    ap.add_argument("--out", default="runs/bench/vllm.json")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--big-layers", type=int, default=14, help="layers of the ~100M random model")
    args = ap.parse_args()
    torch.set_num_threads(2)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    from vllm import LLM
    from vllm import SamplingParams as VSamplingParams

    from services.common.model_files import load_tokenizer
    from services.common.types import SamplingParams
    from services.generation.client import GenerationClient
    from services.generation.server import serve
    from services.training.sources.synthetic import reverse_task

    tok = load_tokenizer(args.model)
    prompts = [tok(r.prompt)["input_ids"] for r in reverse_task("eval", args.prompts)]
    params = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, seed=0)
    results: dict = {
        "prompts": args.prompts,
        "n": args.n,
        "max_new_tokens": args.max_new_tokens,
        "torch_threads": torch.get_num_threads(),
    }

    # vLLM's own offline API and our server (vllm backend, then hf backend) on the same prompts and
    # sampling, in interleaved rounds
    llm = LLM(
        model=args.model,
        dtype="float32",
        enforce_eager=True,
        seed=0,
        max_model_len=32 + args.max_new_tokens,
        logprobs_mode="processed_logprobs",
    )
    vparams = VSamplingParams(
        n=args.n, max_tokens=args.max_new_tokens, seed=0, logprobs=0, stop_token_ids=[tok.eos_token_id]
    )
    inputs = [{"prompt_token_ids": p} for p in prompts]
    fns = {
        "vllm_llm_generate": lambda: sum(
            len(c.token_ids) for o in llm.generate(inputs, vparams, use_tqdm=False) for c in o.outputs
        )
    }
    with contextlib.ExitStack() as stack:
        for backend in ("vllm", "hf"):
            cfg = server_cfg(args.model, backend, args.max_new_tokens)
            svc = stack.enter_context(serve(cfg))
            client = GenerationClient(f"127.0.0.1:{svc.server.port}", cfg.rpc)
            stack.callback(client.close)
            fns[f"server_{backend}"] = lambda client=client: client.generate(prompts, params).tokens
        results.update(interleaved(fns, args.repeats))
    # `llm` stays alive to the end: dropping an in-process vLLM engine tears down the process's
    # parallel state, which the engines started after it share
    results["server_vllm_vs_llm_generate"] = (
        results["server_vllm"]["tokens_per_s"] / results["vllm_llm_generate"]["tokens_per_s"]
    )
    results["server_vllm_vs_server_hf"] = results["server_vllm"]["tokens_per_s"] / results["server_hf"]["tokens_per_s"]

    # 3. weight swaps: the tiny policy and a ~100M-parameter random model
    results["swap_tiny"] = swap_times(Path(args.model), args.repeats)
    with tempfile.TemporaryDirectory() as d:
        params_count = random_llama(Path(d), args.model, args.big_layers, 768)
        results["swap_100m"] = {"parameters": params_count, **swap_times(Path(d), args.repeats)}
        # and both backends' tokens/s on it (a random model runs every completion to its length)
        fns = {}
        with contextlib.ExitStack() as stack:
            for backend in ("vllm", "hf"):
                cfg = server_cfg(d, backend, args.max_new_tokens)
                svc = stack.enter_context(serve(cfg))
                client = GenerationClient(f"127.0.0.1:{svc.server.port}", cfg.rpc)
                stack.callback(client.close)
                fns[f"server_{backend}_100m"] = lambda client=client: client.generate(prompts[:16], params).tokens
            results.update(interleaved(fns, 3))
        results["server_vllm_vs_server_hf_100m"] = (
            results["server_vllm_100m"]["tokens_per_s"] / results["server_hf_100m"]["tokens_per_s"]
        )

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"\n{'what':44s} {'tokens/s':>10s} {'seconds':>9s}")
    for k in ("vllm_llm_generate", "server_vllm", "server_hf", "server_vllm_100m", "server_hf_100m"):
        print(f"{k:44s} {results[k]['tokens_per_s']:10.0f} {results[k]['seconds']:9.3f}")
    print(f"{'server vllm / LLM.generate':44s} {results['server_vllm_vs_llm_generate']:10.2f}x")
    print(f"{'server vllm / server hf (tiny)':44s} {results['server_vllm_vs_server_hf']:10.2f}x")
    print(f"{'server vllm / server hf (100M, 16 prompts)':44s} {results['server_vllm_vs_server_hf_100m']:10.2f}x")
    for k in ("swap_tiny", "swap_100m"):
        r = results[k]
        print(f"{k + ' (%.0f MB)' % r['mb']:44s} push {r['push_s']:.3f}s, engine reload {r['engine_reload_s']:.3f}s")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
