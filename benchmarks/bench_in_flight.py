"""Benchmark: weight updates in flight (`generation.weight_update: in_flight`) against between
batches, on one generation server holding SmolLM2-135M (the `hf` backend), over loopback gRPC.

    OMP_NUM_THREADS=2 nice .venv/bin/python benchmarks/bench_in_flight.py   (about 4 minutes on 2 cores;
        writes runs/bench/in_flight.json, prints the table)

What it measures, per mode (between batches; in flight with the
cache recomputed; in flight with it kept), in one run on one machine: one client keeps the server decoding
(Generate calls back to back: `--prompts` prompts x `--n` samples, up to `--max-new-tokens` tokens,
temperature 1) while the learner's part pushes `--pushes` full versions (the model's weights plus
noise) at moments spread over a batch (a seeded random delay within one batch's length after the
previous push). For each push, from the server's answer (`PushWeightsResponse`): the seconds of
the whole push (what the learner waits), of those the seconds the swap waited for the running batch
(`swap_wait_seconds`: its end between batches, its next decoding step in flight) and the swap's
own; and for the decoding: tokens per second over the pushes' window and the completions whose
tokens came from two versions.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from pathlib import Path

import torch

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "List the steps to bake bread at home.",
    "Describe the water cycle to a child.",
    "What makes a good password? Explain.",
    "Tell me about the history of the printing press.",
    "How do bees make honey?",
    "Write a letter to a friend about a trip to the sea.",
]


class Decoding:
    """Generate calls back to back on a thread until stopped: tokens, seconds, mixed completions."""

    def __init__(self, client, prompts: list[list[int]], params):
        self.client, self.prompts, self.params = client, prompts, params
        self.stop, self.batches = threading.Event(), []  # (t_start, t_end, tokens, mixed completions)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            t0 = time.perf_counter()
            res = self.client.generate(self.prompts, self.params, timeout=600)
            mixed = sum(c.token_versions is not None for cs in res.completions for c in cs)
            self.batches.append((t0, time.perf_counter(), res.tokens, mixed))

    def window(self, t0: float, t1: float) -> tuple[float, int]:
        """Tokens per second of the batches that ended inside [t0, t1], and their mixed completions."""
        inside = [b for b in self.batches if t0 <= b[1] <= t1]
        if not inside:
            return 0.0, 0
        span = inside[-1][1] - min(b[0] for b in inside)
        return sum(b[2] for b in inside) / span, sum(b[3] for b in inside)


MODES = {  # name: (generation.weight_update, generation.in_flight_cache)
    "between_batches": ("between_batches", "recompute"),
    "in_flight": ("in_flight", "recompute"),
    "in_flight+keep": ("in_flight", "keep"),
}


def run_mode(args, mode: str) -> dict:
    from services.common.config import config_from_dict
    from services.common.types import SamplingParams
    from services.generation.client import GenerationClient
    from services.generation.server import serve

    cfg = config_from_dict(
        {
            "model": {"path": args.model, "device": "cpu"},
            "response_length": args.max_new_tokens,
            "prompt_length": 64,
            "generation": {"weight_update": MODES[mode][0], "in_flight_cache": MODES[mode][1]},
            "rpc": {"timeout_s": 600, "generation": {"port": 0, "metrics_port": None}},
        }
    )
    rng = random.Random(0)
    with serve(cfg) as svc:
        backend = svc.servicer.backend
        client = GenerationClient(f"127.0.0.1:{svc.server.port}", cfg.rpc, timeout_s=600)
        prompts = [backend.tokenizer(p)["input_ids"] for p in PROMPTS[: args.prompts]]
        params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens)
        base = {k: v.detach().float().clone() for k, v in backend.model.state_dict().items()}
        dec = Decoding(client, prompts, params)
        dec.thread.start()
        while len(dec.batches) < 1:  # one whole batch first: its length spreads the pushes
            time.sleep(0.1)
        batch_s = dec.batches[0][1] - dec.batches[0][0]
        rows, t_first = [], time.perf_counter()
        for version in range(1, args.pushes + 1):
            time.sleep(rng.uniform(0, batch_s))
            state = {k: v + 1e-4 * torch.randn_like(v) if v.is_floating_point() else v for k, v in base.items()}
            r = client.update_weights(state, version)
            rows.append({"seconds": r.seconds, "wait_s": r.swap_wait_seconds, "swap_s": r.swap_seconds})
            print(
                f"  {mode}: push v{version}: {r.seconds:.2f}s, waited {r.swap_wait_seconds:.2f}s for the batch, "
                f"swap {r.swap_seconds:.2f}s",
                flush=True,
            )
        t_last = time.perf_counter()
        dec.stop.set()
        dec.thread.join(600)
        tok_s, mixed = dec.window(t_first, t_last + batch_s)
        client.close()
    return {
        "mode": mode,
        "batch_s": batch_s,
        "push_s": statistics.mean(r["seconds"] for r in rows),
        "push_s_max": max(r["seconds"] for r in rows),
        "wait_s": statistics.mean(r["wait_s"] for r in rows),
        "wait_s_max": max(r["wait_s"] for r in rows),
        "swap_s": statistics.mean(r["swap_s"] for r in rows),
        "tokens_per_s": tok_s,
        "mixed_completions": mixed,
        "pushes": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="runs/smollm2-135m")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--pushes", type=int, default=8)
    ap.add_argument("--out", default="runs/bench/in_flight.json")
    args = ap.parse_args()
    results = [run_mode(args, mode) for mode in MODES]
    print(
        f"\n{args.prompts} prompts x n={args.n}, up to {args.max_new_tokens} new tokens, {args.pushes} full pushes, "
        f"{torch.get_num_threads()} threads"
    )
    print(
        f"{'weight_update':16} {'batch s':>8} {'push s':>7} {'max':>6} {'waited s':>9} {'max':>6} {'swap s':>7} "
        f"{'tok/s':>7} {'mixed':>6}"
    )
    for r in results:
        print(
            f"{r['mode']:16} {r['batch_s']:8.2f} {r['push_s']:7.2f} {r['push_s_max']:6.2f} {r['wait_s']:9.2f} "
            f"{r['wait_s_max']:6.2f} {r['swap_s']:7.2f} {r['tokens_per_s']:7.0f} {r['mixed_completions']:6d}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
