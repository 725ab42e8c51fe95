"""Benchmark: the cost of the service layer for generation, and weight push throughput.

    make bench           (writes runs/bench/services.json and prints a table)

Measures, in one run on one machine: generation tokens/s of the HF backend called in-process vs
the same backend behind the gRPC server on loopback (same batch, same sampling, seeded), and
PushWeights seconds and MB/s for the policy's full state dict (and a larger synthetic one).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="runs/tiny-model")
    ap.add_argument("--out", default="runs/bench/services.json")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--push-mb", type=float, default=64.0, help="size of the synthetic push")
    args = ap.parse_args()
    torch.set_num_threads(2)

    from services.common.config import config_from_dict
    from services.common.types import SamplingParams
    from services.generation.backend import HFBackend
    from services.generation.client import GenerationClient
    from services.generation.server import serve
    from services.training.sources.synthetic import reverse_task

    cfg = config_from_dict(
        {
            "model": {"path": args.model, "device": "cpu"},
            "prompt_length": 32,
            "response_length": args.max_new_tokens,
            "generation": {"batch_window_ms": 1},
            "rpc": {"generation": {"port": 0, "metrics_port": None}},
        }
    )
    backend = HFBackend(args.model, "cpu")
    prompts = [backend.tokenizer(r.prompt)["input_ids"] for r in reverse_task("eval", args.prompts)]
    params = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, seed=0)
    service = serve(cfg, backend=backend).start()
    server = service.server
    client = GenerationClient(f"127.0.0.1:{server.port}", cfg.rpc)

    def timed(fn):
        fn()  # warm-up
        rates, secs = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            res = fn()
            dt = time.perf_counter() - t0
            secs.append(dt)
            rates.append(res.tokens / dt)
        return statistics.median(rates), statistics.median(secs)

    # the same seeded batch through both paths, one after the other
    inproc_rate, inproc_s = timed(lambda: backend.generate(prompts, params))
    server_rate, server_s = timed(lambda: client.generate(prompts, params))

    state = backend.model.state_dict()
    policy_mb = sum(t.numel() * t.element_size() for t in state.values()) / 1e6
    pushes = []
    for i in range(3):
        t0 = time.perf_counter()
        client.update_weights(state, backend.policy_version + 1)
        pushes.append(time.perf_counter() - t0)
    # the server only accepts its model's own tensors, so a larger payload times the chunk codec
    # (encode, crc32/sha256, assemble) in-process
    from services.weights.assemble import assemble_weights
    from services.weights.stream import StreamSpec, weight_chunks

    big = {f"t{i}": torch.randn(1024, 1024) for i in range(int(args.push_mb // 4.194304) or 1)}
    big_mb = sum(t.numel() * 4 for t in big.values()) / 1e6
    t0 = time.perf_counter()
    assemble_weights(weight_chunks(big, StreamSpec(1)))
    codec_s = time.perf_counter() - t0
    service.stop()

    result = {
        "batch": {"prompts": args.prompts, "n": args.n, "max_new_tokens": args.max_new_tokens},
        "generation_tokens_per_s_inprocess": round(inproc_rate, 1),
        "generation_tokens_per_s_server": round(server_rate, 1),
        "generation_seconds_inprocess": round(inproc_s, 4),
        "generation_seconds_server": round(server_s, 4),
        "server_overhead_ratio": round(server_s / inproc_s, 3),
        "push_policy_mb": round(policy_mb, 3),
        "push_policy_seconds_median": round(statistics.median(pushes), 4),
        "push_policy_mb_per_s": round(policy_mb / statistics.median(pushes), 1),
        "codec_mb": round(big_mb, 1),
        "codec_seconds": round(codec_s, 3),
        "codec_mb_per_s": round(big_mb / codec_s, 1),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    width = max(len(k) for k in result)
    for k, v in result.items():
        print(f"{k:<{width}}  {v}")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
