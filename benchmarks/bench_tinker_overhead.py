"""Benchmark: what the Tinker API adds to a training step, the SDK's round trips against the
compute they wait for.

    python benchmarks/bench_tinker_overhead.py -c configs/smollm2-cpu.yaml [--datums 8] [--rank 16]
        [--steps 5] [--out runs/bench/tinker_overhead.json]

Serves the Tinker API in this process on `model.path` and, through the official SDK, trains a
LoRA of `--rank` with `--steps` steps of `forward_backward` (cross_entropy on
`--datums` arithmetic chats) + `optim_step`, after one step to warm. For each step: the wall
seconds the SDK waited (both futures' results), and the seconds the server's compute thread spent
on the two requests (its own `rlhf_tinker_work_seconds`: the forward, backward and Adam step, what
a step inside a trainer costs). The overhead is the difference: HTTP, the protobuf and JSON of
both ways, the futures and their polling. Prints each step and the median overhead in percent.

With `--trainer` the training model lives in a trainer of the API's own (`rlhf serve
tinker-trainer`, started in this process, gRPC over loopback: `tinker.trainer`): the compute is
then the trainer's (its compute thread's seconds on the two calls), and the overhead adds the
API's hop to it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _batch(tok, n: int):
    from tinker import types

    data = []
    for i in range(n):
        a, b = 17 + 7 * i, 36 + 5 * i
        text = f"<|im_start|>user\nWhat is {a} + {b}?<|im_end|>\n<|im_start|>assistant\n{a} + {b} = {a + b}<|im_end|>"
        ids = tok.encode(text)
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
            )
        )
    return data


def _trainer(cfg, work: list[float]):
    """A tinker-trainer on a free port, `cfg` pointed at it, each piece of its compute thread's
    work timed into `work`."""
    from services.tinker.trainer_server import serve as serve_trainer

    cfg.rpc.tinker_trainer.port, cfg.rpc.tinker_trainer.metrics_port = 0, None
    trainer = serve_trainer(cfg).start()
    cfg.tinker.trainer = f"127.0.0.1:{trainer.server.port}"
    compute = trainer.servicer.compute
    run = compute.run

    def timed(fn, *a, **kw):
        t0 = time.perf_counter()
        try:
            return run(fn, *a, **kw)
        finally:
            work.append(time.perf_counter() - t0)

    compute.run = timed
    return trainer


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-c", "--config", default="configs/smollm2-cpu.yaml")
    p.add_argument("--datums", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default="runs/bench/tinker_overhead.json")
    p.add_argument("--trainer", action="store_true", help="train in a tinker-trainer over loopback gRPC")
    p.add_argument("--set", action="append", default=[], help="KEY=VALUE over the config")
    args = p.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    os.environ.setdefault("RLHF_AUTH_TOKEN", "bench")

    import tinker
    from tinker import types

    from services.common.config import load_config
    from services.common.model_files import load_tokenizer
    from services.tinker.server import serve

    sets = ["tinker.port=0", "tinker.model_name=bench", f"tinker.root={ROOT}/runs/bench/tinker"]
    cfg = load_config(args.config, sets + args.set)
    work: list[float] = []
    trainer = _trainer(cfg, work) if args.trainer else None
    svc = serve(cfg).start()
    if trainer is None:
        told = svc.api.on_work
        svc.api.on_work = lambda kind, seconds: (work.append(seconds), told(kind, seconds))
    tok = load_tokenizer(cfg.model.path)
    batch = _batch(tok, args.datums)
    tokens = sum(len(d.model_input.to_ints()) for d in batch)
    rows = []
    try:
        with tinker.ServiceClient(base_url=f"http://127.0.0.1:{svc.port}", api_key="tml-bench") as sc:
            tc = sc.create_lora_training_client(base_model="bench", rank=args.rank, seed=0).result()
            adam = types.AdamParams(learning_rate=1e-4)
            for step in range(args.steps + 1):
                work.clear()
                t0 = time.perf_counter()
                fb = tc.forward_backward(batch, "cross_entropy")
                opt = tc.optim_step(adam)
                loss = fb.result().metrics["loss:sum"]
                opt.result()
                wall = time.perf_counter() - t0
                compute = sum(work)
                if step:  # the first warms
                    rows.append({"step": step, "wall_s": wall, "compute_s": compute, "loss": loss})
                    print(
                        f"step {step}: {wall:.3f} s waited, {compute:.3f} s computed, "
                        f"overhead {wall - compute:.3f} s ({100 * (wall - compute) / compute:.1f}%), loss {loss:.2f}",
                        flush=True,
                    )
    finally:
        svc.stop()
        if trainer is not None:
            trainer.stop()
    overhead = statistics.median((r["wall_s"] - r["compute_s"]) / r["compute_s"] for r in rows)
    print(
        f"{args.datums} datums ({tokens} tokens), LoRA rank {args.rank}{', in a trainer' if trainer else ''}: "
        f"median overhead {100 * overhead:.1f}% "
        f"of the compute ({statistics.median(r['compute_s'] for r in rows):.3f} s a step)"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "tokens": tokens, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
