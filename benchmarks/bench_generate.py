"""Benchmark: the `hf` backend's sampling on a real model, against transformers' `generate`.

    python benchmarks/bench_generate.py -c configs/smollm2-cpu.yaml [--repeats 3] [--out runs/bench/generate.json]
    .venv-vllm/bin/python benchmarks/bench_generate.py -c configs/smollm2-cpu.yaml --vllm float32   (+ vllm)

One rollout of the config (rollout_batch_size prompts x num_return_sequences_in_group samples,
response_length new tokens at the training temperature, the config's own prompts) four ways, each
round running every way in turn (noise hits all alike), medians over the rounds:
  - `generate`: transformers' `generate` on the prompts repeated n times, `output_scores=True`
    and the log-softmax of the stacked scores (what the `hf` backend did before `decode`);
  - `decode fp32` and `decode bf16`: services/generation/decode.py (each prompt prefilled once,
    log-probs kept step by step, finished rows dropped), the policy in float32 / bfloat16;
  - `prefill x n`: `decode` with each prompt listed n times (n = 1): what sharing the prefill saves;
  - with `--vllm DTYPE`: the `vllm` backend (vLLM's engine, its CPU build here; prefix caching on,
    eager mode) in that dtype, `n` samples per prompt as the generation server asks for them (one
    engine per process: run once per dtype).
Prints seconds and generated tokens/s (peak memory: benchmarks/bench_memory.py --iteration).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--config", default="configs/smollm2-cpu.yaml")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--vllm",
        choices=["float32", "bfloat16"],
        help="also the vllm backend in this dtype (run with the vLLM venv's Python)",
    )
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    from services.common.config import load_config
    from services.common.padding import pad_left
    from services.common.types import SamplingParams
    from services.generation.backend import HFBackend
    from services.generation.decode import decode
    from services.training.data import config_prompts

    cfg = load_config(args.config)
    fp32 = HFBackend(cfg.model.path, "cpu")
    bf16 = HFBackend(cfg.model.path, "cpu", torch.bfloat16)
    records = config_prompts(cfg, "train", fp32.tokenizer)[: cfg.rollout_batch_size]
    prompts = [fp32.tokenizer(r.prompt, add_special_tokens=False)["input_ids"] for r in records]
    params = SamplingParams.for_training(cfg)
    n, pad, eos = params.n, fp32.pad_token_id, [fp32.eos_token_id]

    def hf_generate():
        ids, attn = pad_left([p for p in prompts for _ in range(n)], pad)
        out = fp32.model.generate(
            input_ids=ids,
            attention_mask=attn,
            do_sample=True,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k or None,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=eos,
            pad_token_id=pad,
            output_scores=True,
            return_dict_in_generate=True,
        )
        seqs = out.sequences[:, ids.shape[1] :]
        F.log_softmax(torch.stack(out.scores, 1).float(), -1).gather(-1, seqs.unsqueeze(-1))
        return int((seqs != pad).sum())

    def way(backend, share: bool):
        def run():
            if share:
                out = decode(backend.model, prompts, params, pad, eos)
            else:
                out = decode(
                    backend.model, [p for p in prompts for _ in range(n)], dataclasses.replace(params, n=1), pad, eos
                )
            return sum(len(t) for t in out.tokens)

        return run

    ways = {
        "generate": hf_generate,
        "decode fp32": way(fp32, True),
        "decode bf16": way(bf16, True),
        "prefill x n": way(fp32, False),
    }
    if args.vllm:
        from services.generation.vllm_backend import VLLMBackend

        vcfg = cfg.generation.vllm.model_copy(update={"enforce_eager": True, "cpu_kvcache_space_gb": 4})
        engine = VLLMBackend(
            cfg.model.path, vcfg, dtype=args.vllm, max_model_len=cfg.prompt_length + cfg.response_length
        )
        ways[f"vllm {args.vllm}"] = lambda: engine.generate(prompts, params).tokens
    times: dict[str, list[float]] = {k: [] for k in ways}
    toks: dict[str, list[int]] = {k: [] for k in ways}
    with torch.no_grad():
        for r in range(args.repeats + 1):
            for name, fn in ways.items():
                t0 = time.perf_counter()
                k = fn()
                dt = time.perf_counter() - t0
                if r == 0:  # the warm-up round
                    continue
                times[name].append(dt)
                toks[name].append(k)
    rows = {
        name: {
            "s": statistics.median(times[name]),
            "tokens": statistics.median(toks[name]),
            "tokens_per_s": statistics.median(k / t for k, t in zip(toks[name], times[name])),
        }
        for name in ways
    }
    base = rows["generate"]["tokens_per_s"]
    print(
        f"{len(prompts)} prompts x {n} samples, {params.max_new_tokens} new tokens, T {params.temperature}, "
        f"{cfg.model.path}, {torch.get_num_threads()} threads, median of {args.repeats}"
    )
    print(f"{'way':<14}{'s':>8}{'tokens':>8}{'tok/s':>8}{'vs generate':>13}")
    for name, row in rows.items():
        print(
            f"{name:<14}{row['s']:>8.2f}{row['tokens']:>8.0f}{row['tokens_per_s']:>8.1f}"
            f"{row['tokens_per_s'] / base:>12.2f}x"
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"config": args.config, "rows": rows}, indent=1))
    if args.vllm:
        engine.close()


if __name__ == "__main__":
    main()
