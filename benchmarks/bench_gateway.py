"""Benchmark: the gateway's OpenAI-compatible endpoint against direct gRPC Generate, on one model.

    python benchmarks/bench_gateway.py -c configs/smollm2-cpu.yaml [--sessions 4] [--turns 3] [--tokens 16]

Starts `rlhf serve generation` and `rlhf serve gateway` as processes (as a user runs them), then:
  1. `--sessions` sessions one after another, `--turns` turns each, through the `openai` client
     (greedy, `--tokens` new tokens a turn; each turn's messages extend the session's);
  2. the same turns' prompts, read back from the sessions' token-exact records, sent straight to
     the generation server with `GenerationClient.generate` (the same token ids, the same
     parameters): what the endpoint adds is the difference;
  3. the sessions all at once (a thread each), through the gateway and direct.
Prints seconds per turn (median), the endpoint's added latency per turn, sessions/s and
generated tokens/s both ways.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def start(args: list[str], log: Path, root: Path = ROOT) -> tuple[subprocess.Popen, dict]:
    """`rlhf ARGS` run from the checkout `root`, once it says LISTENING: (the process, its endpoints)."""
    out = open(log, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", *args], cwd=root, stdout=subprocess.PIPE, stderr=out, text=True
    )
    t0 = time.time()
    while time.time() - t0 < 300:
        line = proc.stdout.readline()
        if line.startswith("LISTENING"):
            return proc, dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)
        if proc.poll() is not None:
            break
    raise SystemExit(f"{args[:3]} did not start: see {log}")


def session_turns(client, sid: str, turns: int, tokens: int) -> list[tuple[float, int]]:
    """One session through the endpoint: (seconds, completion tokens) per turn."""
    messages = [{"role": "user", "content": f"What is {17 + len(sid)} + {25 * len(sid)}?"}]
    out = []
    for turn in range(turns):
        t0 = time.perf_counter()
        r = client.chat.completions.create(
            model="policy", messages=messages, temperature=0, max_tokens=tokens, extra_headers={"x-session-id": sid}
        )
        out.append((time.perf_counter() - t0, r.usage.completion_tokens))
        messages += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": f"Check it again, step {turn + 1}."},
        ]
    return out


def turn_prompts(record: dict) -> list[list[int]]:
    """Each turn's prompt in a session record: the tokens before each run of sampled ones."""
    (traj,) = record["trajectories"]
    ids, mask = traj["token_ids"], traj["loss_mask"]
    return [ids[:i] for i in range(1, len(mask)) if mask[i] == 1 and mask[i - 1] == 0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--config", default="configs/smollm2-cpu.yaml")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--out", default="runs/bench/gateway.json")
    args = ap.parse_args()

    import httpx
    import openai

    from services.common.config import config_from_dict
    from services.common.types import SamplingParams
    from services.generation.client import GenerationClient

    logs = ROOT / "runs" / "bench" / "gateway"
    logs.mkdir(parents=True, exist_ok=True)
    # a session's budget after its first prompt: every turn's reply and the user's words between
    budget = args.turns * (args.tokens + 64)
    sets = ["--set", "prompt_length=1024", "--set", f"response_length={budget}", "--set", "rpc.auth_token=null"]
    env_token = os.environ.pop("RLHF_AUTH_TOKEN", None)
    gen, g = start(
        ["serve", "generation", "-c", args.config, *sets, "--port", "0", "--metrics-port", "-1"], logs / "gen.log"
    )
    gw, w = start(
        ["serve", "gateway", "-c", args.config, *sets, "--set", f"rpc.generation.port={g['port']}", "--port", "0"],
        logs / "gateway.log",
    )
    try:
        base = f"http://127.0.0.1:{w['http_port']}/v1"
        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=600)
        direct = GenerationClient(f"127.0.0.1:{g['port']}", config_from_dict({"rpc": {"timeout_s": 600}}).rpc)
        params = SamplingParams(n=1, temperature=0.0, max_new_tokens=args.tokens)
        session_turns(client, "warm-up", 1, args.tokens)  # the first forward's one-time costs
        direct.generate([[1, 2, 3]], params)

        # 1 + 2: one session at a time, then its prompts straight to the server
        via_gw, via_direct, tokens = [], [], 0
        for s in range(args.sessions):
            sid = f"seq-{s}"
            turns = session_turns(client, sid, args.turns, args.tokens)
            via_gw += [t for t, _ in turns]
            tokens += sum(n for _, n in turns)
            record = httpx.get(f"{base}/sessions/{sid}").json()
            for prompt in turn_prompts(record):
                t0 = time.perf_counter()
                direct.generate([prompt], params)
                via_direct.append(time.perf_counter() - t0)
        # 3: every session at once
        conc: dict[str, float] = {}
        records = []

        def one(i):
            session_turns(client, f"conc-{i}", args.turns, args.tokens)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(args.sessions)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        conc["gateway_s"] = time.perf_counter() - t0
        for i in range(args.sessions):
            records.append(turn_prompts(httpx.get(f"{base}/sessions/conc-{i}").json()))

        def replay(prompts):
            for p in prompts:
                direct.generate([p], params)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=replay, args=(p,)) for p in records]
        [t.start() for t in threads]
        [t.join() for t in threads]
        conc["direct_s"] = time.perf_counter() - t0
        direct.close()
    finally:
        for p in (gw, gen):
            p.terminate()
            p.wait(60)
        if env_token is not None:
            os.environ["RLHF_AUTH_TOKEN"] = env_token

    n_turns = len(via_gw)
    row = {
        "config": args.config,
        "sessions": args.sessions,
        "turns": args.turns,
        "tokens_per_turn": args.tokens,
        "gateway_turn_s": statistics.median(via_gw),
        "direct_turn_s": statistics.median(via_direct),
        "added_per_turn_s": statistics.median(via_gw) - statistics.median(via_direct),
        "gateway_tokens_per_s": tokens / sum(via_gw),
        "direct_tokens_per_s": tokens / sum(via_direct),
        "concurrent_gateway_sessions_per_s": args.sessions / conc["gateway_s"],
        "concurrent_direct_sessions_per_s": args.sessions / conc["direct_s"],
    }
    print(f"{args.sessions} sessions x {args.turns} turns, {args.tokens} new tokens a turn (greedy), {args.config}")
    print(f"{'way':10s} {'s/turn':>8s} {'tok/s':>8s} {'sessions/s (all at once)':>26s}")
    print(
        f"{'gateway':10s} {row['gateway_turn_s']:8.3f} {row['gateway_tokens_per_s']:8.1f} "
        f"{row['concurrent_gateway_sessions_per_s']:26.3f}"
    )
    print(
        f"{'direct':10s} {row['direct_turn_s']:8.3f} {row['direct_tokens_per_s']:8.1f} "
        f"{row['concurrent_direct_sessions_per_s']:26.3f}"
    )
    print(f"the endpoint adds {1000 * row['added_per_turn_s']:.1f} ms a turn (median of {n_turns} turns each way)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
