"""Benchmark: delta weight pushes (`rpc.delta_push`) against full ones, on SmolLM2-135M.

    OMP_NUM_THREADS=1 nice .venv/bin/python benchmarks/bench_delta_push.py   (about 5 minutes on 2 cores;
        writes runs/bench/delta_push.json, prints the tables)

What it measures, in one run on one machine:

- the weights: SmolLM2 (`--model`, a Hugging Face directory) trained by AdamW (lr 2e-5) on random
  tokens; the versions after 1 and after 10 optimiser steps, each against the weights before
  the first (what a server holding the previous version is sent when the learner pushes after 1
  or after 10 steps), in float32 and in bfloat16 (the float32 weights rounded);
- the compressor: zstd at a few levels and zlib level 1 on the same XOR planes, one thread:
  the share of the bytes left and MB/s of raw bytes in;
- the encoding and the assembly on their own (`encode_weights` on its threads, `assemble_weights`
  against the base): seconds, no network;
- a real push: `Publisher.push` to one generation server (`serve`, the `hf` backend holding
  SmolLM2) over loopback gRPC, end to end (the learner's snapshot, the encoding, the stream, the
  server's assembly, checks and swap), with `rpc.delta_push` on (a delta, the server holding the
  weights before the steps) and off (the full version), alternately, `--repeats` of each; bytes
  on the wire and seconds per push. A bfloat16 server is the `hf` backend holding the model in
  bfloat16 and told to take bfloat16 versions (the project's servers take float32 ones and cast
  them: a bf16 wire is what the bf16 rows would be worth).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def train_states(model_dir: str, steps: list[int], lr: float, seed: int = 0) -> dict[int, dict[str, torch.Tensor]]:
    """{k: the state dict after k AdamW steps} for 0 and every k of `steps` (float32)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    states = {0: {k: v.detach().clone() for k, v in model.state_dict().items()}}
    vocab = model.config.vocab_size
    for step in range(1, max(steps) + 1):
        ids = torch.randint(0, vocab, (2, 32))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step in steps:
            states[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    del model, opt
    return states


def planes_of(new: dict, old: dict) -> list[np.ndarray]:
    """The XOR planes of every tensor, as the encoder makes them (one array per 16 MiB piece)."""
    from services.weights.protocol import CHUNK_BYTES, raw_view

    out = []
    for k, t in new.items():
        a, b = raw_view(t.contiguous()), raw_view(old[k].contiguous())
        size = t.element_size()
        for off in range(0, len(a), CHUNK_BYTES):
            x = np.bitwise_xor(a[off : off + CHUNK_BYTES], b[off : off + CHUNK_BYTES])
            out.append(np.ascontiguousarray(x.reshape(-1, size).T))
    return out


def compressor_rows(planes: list[np.ndarray], levels: list[int], zlib_mb: int) -> list[dict]:
    import zstandard

    raw = sum(p.nbytes for p in planes)
    rows = []
    for level in levels:
        c = zstandard.ZstdCompressor(level=level)
        t0 = time.perf_counter()
        out = sum(len(c.compress(p)) for p in planes)
        secs = time.perf_counter() - t0
        rows.append({"codec": f"zstd {level}", "left": out / raw, "mb_s": raw / secs / 1e6})
    if zlib_mb:  # slow: on the first pieces only
        part, n = [], 0
        for p in planes:
            if n >= zlib_mb << 20:
                break
            part.append(p)
            n += p.nbytes
        t0 = time.perf_counter()
        out = sum(len(zlib.compress(p, 1)) for p in part)
        secs = time.perf_counter() - t0
        rows.append({"codec": f"zlib 1 ({n >> 20} MiB)", "left": out / n, "mb_s": n / secs / 1e6})
    return rows


def offline(new: dict, old: dict) -> dict:
    """Encoding and assembly alone (no network): seconds and bytes, delta and full."""
    from services.weights import delta
    from services.weights.assemble import WeightChunkDecoder, assemble_weights
    from services.weights.stream import StreamSpec, encode_weights

    specs = {k: (tuple(t.shape), t.dtype) for k, t in new.items()}
    out = {}
    for kind in ("full", "delta"):
        t0 = time.perf_counter()
        chunks = list(
            encode_weights(
                new,
                StreamSpec(
                    2, kind=kind, base=old if kind == "delta" else None, base_version=1 if kind == "delta" else 0
                ),
            )
        )
        encode_s = time.perf_counter() - t0
        wire = sum(map(len, chunks))
        decoded = [WeightChunkDecoder().FromString(c) for c in chunks]
        t0 = time.perf_counter()
        _, _, state, _, _ = assemble_weights(
            iter(decoded), specs, base=delta.Base("", 0, 1, old) if kind == "delta" else None
        )
        assemble_s = time.perf_counter() - t0
        assert all(torch.equal(state[k].view(-1).view(torch.uint8), new[k].view(-1).view(torch.uint8)) for k in new)
        out[kind] = {"bytes": wire, "encode_s": encode_s, "assemble_s": assemble_s}
        del chunks, decoded, state
    return out


class Registry:
    """The registry as the publisher reads it: the server's entry as its heartbeat writes it."""

    def __init__(self, services):
        self.services = services

    def live(self, kind):
        return {
            f"127.0.0.1:{s.server.port}": {
                "policy_version": s.servicer.backend.policy_version,
                **s.servicer.registry_info(),
            }
            for s in self.services
        }

    def heartbeat(self, *a, **kw):
        pass

    def publish_learner(self, *a, **kw):
        pass


def pushes(model_dir: str, dtype: torch.dtype, states: dict, steps: list[int], repeats: int) -> list[dict]:
    """Real pushes to one generation server: per step count, `repeats` deltas and full pushes."""
    from services.common.config import config_from_dict
    from services.common.servers import ServerPool
    from services.generation.backend import HFBackend
    from services.generation.client import generation_clients
    from services.generation.server import serve
    from services.weights.publisher import Publisher

    cfg = config_from_dict(
        {
            "model": {"path": model_dir, "device": "cpu"},
            "rpc": {"delta_push": True, "timeout_s": 600, "generation": {"port": 0, "metrics_port": None}},
        }
    )
    off_cfg = cfg.model_copy(update={"rpc": cfg.rpc.model_copy(update={"delta_push": False})})
    backend = HFBackend(model_dir, "cpu", dtype)
    if dtype != torch.float32:  # versions in the engine's dtype (the hf backend takes float32 ones)
        backend._specs = {k: (s, dtype if d.is_floating_point else d) for k, (s, d) in backend._specs.items()}
    rows = []
    with serve(cfg, backend=backend) as svc:
        store = Registry([svc])
        current = {}
        learner = SimpleNamespace(policy_state_dict=lambda: current["state"], device=torch.device("cpu"), lora=False)

        def publisher(c):
            pool = ServerPool(lambda: store.live("generation"), generation_clients(c.rpc), 30.0)
            return Publisher(c, store, learner, pool)

        on, off = publisher(cfg), publisher(off_cfg)
        version = 0

        def push(bc, state, want_delta):
            nonlocal version
            version += 1
            current["state"] = state
            out = bc.push(version, "learner:0")
            assert out["push/failed"] == 0 and out["push/delta"] == int(want_delta), out
            got = svc.servicer.backend.model.state_dict()
            assert all(
                torch.equal(got[k].view(-1).view(torch.uint8), state[k].view(-1).view(torch.uint8)) for k in state
            )
            return out

        try:
            push(off, states[0], False)  # warms the channel and the server's pages
            for k in steps:
                delta_s, full_s, delta_b, full_b = [], [], [], []
                for _ in range(repeats):
                    push(on, states[0], False)  # the server holds the weights before the steps (a full push)
                    out = push(on, states[k], True)  # ... and is sent what the k steps changed
                    delta_s.append(out["time/push_s"])
                    delta_b.append(out["push/bytes"])
                    out = push(off, states[k], False)
                    full_s.append(out["time/push_s"])
                    full_b.append(out["push/bytes"])
                rows.append(
                    {
                        "steps": k,
                        "full_bytes": full_b[0],
                        "delta_bytes": statistics.median(delta_b),
                        "full_s": statistics.median(full_s),
                        "delta_s": statistics.median(delta_s),
                        "full_runs": full_s,
                        "delta_runs": delta_s,
                    }
                )
        finally:
            on.close()
            off.close()
            on.servers.close()
            off.servers.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="runs/smollm2-135m")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--steps", default="1,10")
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--levels", default="-3,1,3", help="zstd levels for the compressor table")
    ap.add_argument("--zlib-mb", type=int, default=64, help="zlib level 1 on this many MiB of planes (0: not)")
    ap.add_argument("--out", default="runs/bench/delta_push.json")
    args = ap.parse_args()
    steps = [int(s) for s in args.steps.split(",")]

    from services.weights.protocol import threads

    t0 = time.perf_counter()
    base = train_states(args.model, steps, args.lr)
    print(f"{max(steps)} AdamW steps in {time.perf_counter() - t0:.0f}s; encoder threads: {threads()}")
    result: dict = {"cpus": os.cpu_count(), "encoder_threads": threads(), "lr": args.lr, "cases": []}
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        states = {k: {n: t.to(dtype) for n, t in s.items()} for k, s in base.items()}
        nbytes = sum(t.numel() * t.element_size() for t in states[0].values())
        for k in steps:
            changed = sum(
                int((states[k][n] != states[0][n]).sum()) for n in states[0] if states[0][n].is_floating_point()
            )
            total = sum(states[0][n].numel() for n in states[0] if states[0][n].is_floating_point())
            planes = planes_of(states[k], states[0])
            comp = compressor_rows(
                planes, [int(x) for x in args.levels.split(",")], args.zlib_mb if k == steps[0] else 0
            )
            del planes
            alone = offline(states[k], states[0])
            result["cases"].append(
                {
                    "dtype": name,
                    "steps": k,
                    "bytes": nbytes,
                    "changed": changed / total,
                    "compressor": comp,
                    "offline": alone,
                }
            )
            print(f"\n{name}, {k} step(s): {nbytes / 1e6:.0f} MB, {changed / total:.1%} of the weights changed")
            for r in comp:
                print(f"  {r['codec']:>16}: {r['left']:6.1%} of the bytes left, {r['mb_s']:5.0f} MB/s (one thread)")
            for kind, r in alone.items():
                print(
                    f"  {kind:>5} alone: {r['bytes'] / 1e6:6.1f} MB, encode {r['encode_s']:.2f}s, "
                    f"assemble {r['assemble_s']:.2f}s"
                )
        for row in pushes(args.model, dtype, states, steps, args.repeats):
            case = next(c for c in result["cases"] if c["dtype"] == name and c["steps"] == row["steps"])
            case["push"] = row
        del states
    print("\nreal pushes over loopback gRPC to one generation server (median of %d):" % args.repeats)
    print("| weights | steps | full MB | delta MB | delta/full | full s | delta s |")
    print("|---|---|---|---|---|---|---|")
    for c in result["cases"]:
        p = c["push"]
        print(
            f"| {c['dtype']} | {c['steps']} | {p['full_bytes'] / 1e6:.0f} | {p['delta_bytes'] / 1e6:.0f} | "
            f"{p['delta_bytes'] / p['full_bytes']:.1%} | {p['full_s']:.2f} | {p['delta_s']:.2f} |"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
