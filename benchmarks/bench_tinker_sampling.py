"""Benchmark: the Tinker API's sample batching, one RL step's sampling as tinker-cookbook sends it.

    python benchmarks/bench_tinker_sampling.py -c configs/smollm2-cpu.yaml [--groups 8] [--group-size 8]
        [--tokens 16] [--batches 1,64] [--repeats 2] [--out runs/bench/tinker_sampling.json]

Serves the Tinker API in this process (the hf backend on `model.path`) once per `--batches` value
(`tinker.sample_batch`: 1 decodes each request alone, as the server did before batching), and
through the official SDK sends `--groups` sample requests at once (the same sampling client,
`--group-size` samples each, `--tokens` new tokens at temperature 1: a math_rl step's
`groups_per_batch x group_size`), waits for all, `--repeats` times. Prints per setting the seconds
a step's sampling took (median), the generate calls it made, the sampled tokens per second and
the most the process's resident memory rose during a step (`memory +MB`, Linux).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = [f"{a}+{b}=" for a, b in zip(range(11, 99, 7), range(23, 99, 5))]


def _measure(cfg_path: str, batch: int, args) -> dict:
    import tinker
    from tinker import types

    from services.common.config import load_config
    from services.common.model_files import load_tokenizer
    from services.tinker.server import serve

    cfg = load_config(cfg_path, [f"tinker.sample_batch={batch}", "tinker.port=0", "tinker.model_name=bench"])
    svc = serve(cfg).start()
    tok = load_tokenizer(cfg.model.path)
    calls: list[int] = []
    decoder = svc.api.engine.decoder
    real = decoder.generate

    def counting(prompts, params, *a, **k):
        calls.append(len(prompts))
        return real(prompts, params, *a, **k)

    decoder.generate = counting  # type: ignore[method-assign]
    try:
        with tinker.ServiceClient(base_url=f"http://127.0.0.1:{svc.port}", api_key="tml-bench") as sc:
            sampler = sc.create_sampling_client(base_model="bench").result()
            prompts = [types.ModelInput.from_ints(tok.encode(p)) for p in PROMPTS[: args.groups]]
            params = types.SamplingParams(max_tokens=args.tokens, temperature=1.0)
            sampler.sample(prompts[0], 1, params).result()  # warm
            seconds, tokens, per_step, grew = [], [], [], []
            for _ in range(args.repeats):
                before = len(calls)
                t0 = time.perf_counter()
                with PeakRss() as peak:
                    futures = [sampler.sample(p, args.group_size, params) for p in prompts]
                    results = [f.result() for f in futures]
                seconds.append(time.perf_counter() - t0)
                grew.append(peak.grew_mb)
                tokens.append(sum(len(s.tokens) for r in results for s in r.sequences))
                per_step.append(len(calls) - before)
    finally:
        svc.stop()
    s = statistics.median(seconds)
    return {
        "sample_batch": batch,
        "seconds": round(s, 2),
        "generate_calls": per_step,
        "tokens": tokens,
        "tokens_per_s": round(statistics.median(tokens) / s, 1),
        "peak_rss_growth_mb": round(max(grew)),
    }


class PeakRss:
    """The most the process's resident memory rose above its level at entry while the block ran
    (read from /proc every 10 ms by a thread): what one step's decoding costs in memory."""

    def __enter__(self) -> "PeakRss":
        self.start = self.peak = _rss_mb()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._done.wait(0.01):
            self.peak = max(self.peak, _rss_mb())

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_mb())

    @property
    def grew_mb(self) -> float:
        return self.peak - self.start


def _rss_mb() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-c", "--config", default="configs/smollm2-cpu.yaml")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="runs/bench/tinker_sampling.json")
    args = p.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    os.environ.setdefault("RLHF_AUTH_TOKEN", "bench")
    rows = [_measure(args.config, int(b), args) for b in args.batches.split(",")]
    print(f"{args.groups} requests x {args.group_size} samples x {args.tokens} tokens, {args.config}")
    print(f"{'sample_batch':>12} {'s/step':>8} {'generate calls':>15} {'tokens/s':>9} {'memory +MB':>10}")
    for r in rows:
        print(
            f"{r['sample_batch']:>12} {r['seconds']:>8} {str(r['generate_calls']):>15} {r['tokens_per_s']:>9} "
            f"{r['peak_rss_growth_mb']:>10}"
        )
    if len(rows) > 1:
        print(f"speed-up of the last over the first: {rows[0]['seconds'] / rows[-1]['seconds']:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
