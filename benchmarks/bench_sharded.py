"""Benchmark: the learner's PPO step in 1 process against 2 processes sharded with FSDP2, on a
model large enough for sharding to matter (a random ~110M-parameter Llama built offline), in one
run on one machine.

    .venv/bin/python benchmarks/bench_sharded.py            (writes runs/bench/sharded.json)

For each process count: the median seconds of a PPO step (make_experience + update: old and
reference log-probs, policy loss with KL, AdamW) over a few steps after a warm-up, each process's
peak resident memory, and the bytes of actor parameters, gradients and optimiser state that each
process holds (its shards), and its resident memory after the steps. On the CPU the processes
share its cores (torchrun gives each one thread; one process uses them all), so what sharding
buys here is memory per process; on GPUs each process brings its own device.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build_model(path: Path, layers: int, hidden: int, vocab: int, intermediate: int | None = None) -> int:
    """A random Llama of the given size, saved as a model directory; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(path))
    return sum(p.numel() for p in model.parameters())


def _rollout(n: int, prompt: int, response: int, vocab: int):
    import torch

    from services.common.types import Rollout

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (prompt,), generator=g).tolist() for _ in range(n)]
    responses = [torch.randint(3, vocab, (response,), generator=g).tolist() for _ in range(n)]
    scores = torch.rand(n, generator=g).tolist()
    return Rollout(prompts, responses, scores, [i // 2 for i in range(n)], None, None, [0] * n)


def _rss_mb() -> float:
    return (
        next(
            int(line.split()[1])
            for line in Path("/proc/self/status").read_text().splitlines()
            if line.startswith("VmRSS:")
        )
        / 1024
    )


def _local_bytes(learner) -> int:
    """Parameters, gradients and optimiser state this process holds (its shards when sharded)."""
    import torch

    def local(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    total = 0
    for p in learner.policy.parameters():
        total += local(p) + (local(p.grad) if p.grad is not None else 0)
    for state in learner.optimizer.state.values():
        total += sum(local(v) for v in state.values() if torch.is_tensor(v) and v.dim())
    if learner.ref is not None:
        total += sum(local(p) for p in learner.ref.parameters())
    return total


def one_process_group(device: str):
    """A sharded learner's group of one process (FSDP2 over a 1-process mesh: NCCL on a GPU), to
    run the sharded code path on a machine with one device."""
    import torch.distributed as tdist

    from services.common.sharding.group import Dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    tdist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    return Dist(0, 1, 0, tdist.new_group(backend="gloo"), device_type=device)


def worker(
    model_dir: str,
    out: str,
    steps: int,
    sequences: int,
    prompt: int,
    response: int,
    device: str = "cpu",
    bf16: bool = False,
    fsdp: bool = False,
) -> None:
    import torch

    from services.common.config import config_from_dict
    from services.common.sharding.followers import follow, release_followers
    from services.common.sharding.group import from_env
    from services.learner.sharded import ShardedPolicyTrainer
    from services.learner.trainer import PolicyTrainer

    cfg = config_from_dict(
        {
            "model": {"path": model_dir, "device": device, "bf16": bf16},
            "adv_estimator": "grpo",
            "num_return_sequences_in_group": 2,
            "rollout_batch_size": sequences // 2,
            "ppo_mini_batch_size": sequences,
            "prompt_length": prompt,
            "response_length": response,
            "use_kl_loss": True,
            "actor_lr": 1e-5,
        }
    )
    dist = from_env(device) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
    if fsdp and dist is None:
        dist = one_process_group(device)
    learner = (
        PolicyTrainer(cfg, total_updates=steps + 1)
        if dist is None
        else ShardedPolicyTrainer(cfg, total_updates=steps + 1, dist=dist)
    )
    loaded = {
        "peak_rss_after_load_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_after_load_mb": _rss_mb(),
    }
    rank = dist.rank if dist else 0
    if dist is not None and not dist.main:
        follow(learner)  # the steps and the gathers of the state dict
    else:
        vocab = learner.policy.config.vocab_size
        rollout = _rollout(sequences, prompt, response, vocab)
        times = []
        for i in range(steps + 1):
            t0 = time.perf_counter()
            learner.step(rollout)
            if device == "cuda":
                torch.cuda.synchronize()
            if i:  # the first is the warm-up
                times.append(time.perf_counter() - t0)
        # what a push sends (gathered to rank 0, on the host), three times, each kept until the next
        # is taken (as the broadcaster keeps its snapshot): from a GPU, the first two allocate
        # page-locked memory, the third reuses the first's
        state_dict_s, pushed = [], {}
        for _ in range(3):
            t0 = time.perf_counter()
            pushed = learner.policy_state_dict()
            state_dict_s.append(time.perf_counter() - t0)
        release_followers(learner)
        Path(out, "times.json").write_text(
            json.dumps({"steps": times, "state_dict_s": state_dict_s, "state_dict_tensors": len(pushed)})
        )
    Path(out, f"rank{rank}.json").write_text(
        json.dumps(
            {
                **loaded,
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "rss_after_mb": _rss_mb(),
                "actor_state_mb": _local_bytes(learner) / 1e6,
                "threads": torch.get_num_threads(),
                "gpu_peak_mb": torch.cuda.max_memory_allocated() / 1e6 if device == "cuda" else None,
            }
        )
    )


def run(nproc: int, model_dir: Path, args, fsdp: bool = False) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"bench-sharded-{nproc}-"))
    worker_args = [
        str(model_dir),
        str(out),
        str(args.steps),
        str(args.sequences),
        str(args.prompt),
        str(args.response),
        args.device,
        str(int(args.bf16)),
        str(int(fsdp)),
    ]
    if nproc == 1:
        cmd = [sys.executable, __file__, "--worker", *worker_args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            __file__,
            "--worker",
            *worker_args,
        ]
    print(f"[{nproc} process(es)] {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{nproc} processes failed:\n{proc.stderr[-3000:]}")
    timing = json.loads((out / "times.json").read_text())
    times = timing["steps"]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
    return {
        "nproc": nproc,
        "fsdp": fsdp or nproc > 1,
        "step_s": statistics.median(times),
        "step_s_all": times,
        "state_dict_s": timing["state_dict_s"],
        "gpu_peak_mb": [r["gpu_peak_mb"] for r in ranks],
        "peak_rss_after_load_mb": [round(r["peak_rss_after_load_mb"]) for r in ranks],
        "rss_after_load_mb": [round(r["rss_after_load_mb"]) for r in ranks],
        "peak_rss_mb": [round(r["peak_rss_mb"]) for r in ranks],
        "rss_after_steps_mb": [round(r["rss_after_mb"]) for r in ranks],
        "actor_state_mb_per_process": [round(r["actor_state_mb"]) for r in ranks],
        "threads_per_process": ranks[0]["threads"],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="runs/bench/sharded.json")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--vocab", type=int, default=16000)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--response", type=int, default=48)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (one process: --runs plain,fsdp1 on one GPU)")
    p.add_argument("--bf16", action="store_true", help="model.bf16: bfloat16 autocast over float32 weights")
    p.add_argument(
        "--runs",
        default="1,2",
        help="process counts; fsdp1 = one process sharded by FSDP2 (the sharded code path on one device)",
    )
    p.add_argument("--intermediate", type=int, default=None, help="MLP width (default: 8/3 of --hidden)")
    p.add_argument("--worker", nargs=9)
    args = p.parse_args()
    if args.worker:
        model_dir, out, steps, sequences, prompt, response, device, bf16, fsdp = args.worker
        worker(model_dir, out, int(steps), int(sequences), int(prompt), int(response), device, bf16 == "1", fsdp == "1")
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        params = build_model(model_dir, args.layers, args.hidden, args.vocab, args.intermediate)
        print(
            f"model: {params / 1e6:.1f}M parameters, {args.sequences} sequences of {args.prompt}+{args.response} "
            f"tokens per step, {args.device}{' bf16' if args.bf16 else ''}",
            flush=True,
        )
        results = [
            run(1, model_dir, args, fsdp=True) if r == "fsdp1" else run(int(r), model_dir, args)
            for r in args.runs.split(",")
        ]
    report = {
        "parameters": params,
        "sequences": args.sequences,
        "prompt": args.prompt,
        "response": args.response,
        "cpu_count": os.cpu_count(),
        "device": args.device,
        "bf16": args.bf16,
        "runs": results,
    }
    if len(results) == 2:
        one, two = results
        report["step_time_ratio_2_over_1"] = two["step_s"] / one["step_s"]
        report["actor_state_ratio_2_over_1"] = (
            max(two["actor_state_mb_per_process"]) / one["actor_state_mb_per_process"][0]
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(
        f"{'processes':>10} {'fsdp':>5} {'step s':>8} {'actor state MB/process':>24} "
        f"{'peak RSS MB/process: load, run':>32} {'RSS after steps MB':>20} {'GPU peak MB':>12} "
        f"{'state dict s (1st, 2nd, 3rd)':>36}"
    )
    for r in results:
        gpu = max(r["gpu_peak_mb"]) if r["gpu_peak_mb"][0] is not None else float("nan")
        print(
            f"{r['nproc']:>10} {str(r['fsdp']):>5} {r['step_s']:>8.2f} {str(r['actor_state_mb_per_process']):>24} "
            f"{str(r['peak_rss_after_load_mb']) + ' ' + str(r['peak_rss_mb']):>32} "
            f"{str(r['rss_after_steps_mb']):>20} {gpu:>12.0f} " + "".join(f"{x:>12.2f}" for x in r["state_dict_s"])
        )
    if "step_time_ratio_2_over_1" in report:
        print(
            f"{results[1]['nproc']} vs {results[0]['nproc']} process: step time "
            f"x{report['step_time_ratio_2_over_1']:.2f}, actor state per process "
            f"x{report['actor_state_ratio_2_over_1']:.2f}"
        )
    print(f"results in {args.out}")


if __name__ == "__main__":
    main()
