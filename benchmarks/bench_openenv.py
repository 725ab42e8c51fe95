"""Benchmark: what the OpenEnv hop costs a session's turn (docs/environments.md, "OpenEnv").

    python benchmarks/bench_openenv.py -c configs/tiny-cpu.yaml [--sessions 8] [--turns 3] [--tokens 8] [--rounds 5]

The same environment three ways, each turn the same message ("again="), `--turns` replies of
`--tokens` tokens a session, the last one rewarded:
  plain    a gym-like class in `rollout.environment` (reset(sample), step(reply)): no OpenEnv
  class    an OpenEnv Environment class run in this process (`openenv:...`)
  server   the same class behind OpenEnv's own server (`openenv+http://...`, started here as a
           process of its own: `--serve PORT`), one WebSocket per session
1. `--sessions` sessions at once through AgentHost, every turn sampled by the model in this process
   (as `rlhf train --local` samples them), `--rounds` rounds with the ways taken in turn: the
   median seconds of a round, per turn of a session, and what each way adds to plain's;
2. the environment's own calls without the model: one session's reset and `--turns` x 50 steps,
   the median milliseconds of a step each way.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from openenv.core.env_server.interfaces import Environment  # noqa: E402
from openenv.core.env_server.types import Action, Observation, State  # noqa: E402
from pydantic import Field  # noqa: E402

# the episode's length and a reply's limit: --turns and --tokens, through the environment (this file is
# loaded again by `rollout.environment`, and by the server's process)
TURNS = int(os.environ.get("BENCH_OPENENV_TURNS", "3"))
TOKENS = int(os.environ.get("BENCH_OPENENV_TOKENS", "8"))


class Reply(Action):
    text: str = Field(..., description="the policy's reply")


class Said(Observation):
    prompt: str = Field(default="", description="what the policy is told")


class Fixed(Environment):
    """`TURNS` replies, each answered "again=", the last rewarded with its length (an OpenEnv Environment)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State()

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, prompt: str = "", **kw: Any) -> Said:
        self._state = State(episode_id=episode_id, step_count=0)
        return Said(prompt=prompt)

    def step(self, action: Reply, timeout_s: Optional[float] = None, **kw: Any) -> Said:
        self._state.step_count += 1
        if self._state.step_count >= TURNS:
            return Said(done=True, reward=float(len(action.text)))
        return Said(prompt="again=", reward=0.0)

    @property
    def state(self) -> State:
        return self._state


class Plain:
    """The same episode as a gym-like class (`rollout.environment: file.py:Plain`)."""

    max_tokens = TOKENS

    def reset(self, sample) -> str:
        self.turns = 0
        return sample.prompt

    def step(self, reply: str):
        self.turns += 1
        if self.turns >= TURNS:
            return None, float(len(reply)), True
        return "again=", 0.0, False


def serve(port: int) -> None:
    import uvicorn
    from openenv.core.env_server.http_server import create_app

    uvicorn.run(create_app(Fixed, Reply, Said, max_concurrent_envs=256), host="127.0.0.1", port=port, log_level="error")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-c", "--config", default="configs/tiny-cpu.yaml")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--serve", type=int, default=None, help="serve the environment on this port (internal)")
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve)
        return
    os.environ.update(BENCH_OPENENV_TURNS=str(args.turns), BENCH_OPENENV_TOKENS=str(args.tokens))

    import httpx

    from services.agents.host import agent_host, session_name
    from services.agents.openenv_ref import parse_openenv
    from services.agents.openenv_sessions import LocalSession, ServerSession
    from services.common.config import load_config
    from services.common.model_files import load_tokenizer
    from services.common.types import PromptRecord, SamplingParams
    from services.generation.inprocess import in_process_pool
    from services.generation.policy import make_backend

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port)],
        cwd=ROOT,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).is_success:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and server.poll() is None, "the OpenEnv server did not start"
            time.sleep(0.1)
        me = Path(__file__).resolve()
        ways = {
            "plain": f"{me}:Plain",
            "class": f"openenv:{me}:Fixed?max_tokens={args.tokens}",
            "server": f"openenv+{url}?max_tokens={args.tokens}",
        }
        sets = [
            "prompt_length=64",
            f"response_length={(args.tokens + 16) * args.turns}",
            f"rollout.max_turns={args.turns}",
            "rollout.agent_timeout_s=600",
        ]
        base = load_config(ROOT / args.config if not Path(args.config).is_absolute() else args.config, sets)
        tok = load_tokenizer(base.model.path)
        backend = make_backend(base)
        pool = in_process_pool(backend, base)
        hosts = {}
        for way, ref in ways.items():
            cfg = load_config(ROOT / args.config, [*sets, f"rollout.environment={ref}"])
            host = agent_host(cfg, tok, pool, SamplingParams.for_training(cfg), port=0)
            hosts[way] = host
        print(
            f"{args.sessions} sessions at once x {args.turns} turns, {args.tokens} tokens a reply, {args.config} "
            f"({base.model.path}), {args.rounds} rounds"
        )
        records = [PromptRecord(f"p{i}", "abcd=", "dcba") for i in range(args.sessions)]
        times: dict[str, list[float]] = {w: [] for w in ways}
        tokens: dict[str, list[int]] = {w: [] for w in ways}
        for r in range(args.rounds + 1):  # round 0 warms up
            for way, host in hosts.items():
                t0 = time.perf_counter()
                episodes = host.run([(rec, session_name(rec.id, r)) for rec in records])
                dt = time.perf_counter() - t0
                bad = [e.error for e in episodes if e.error is not None]
                assert not bad, bad[0]
                assert all(e.trajectory["turns"] == args.turns for e in episodes), (
                    way,
                    [(e.trajectory["turns"], len(e.trajectory["token_ids"]), e.reward) for e in episodes],
                )
                if r:
                    times[way].append(dt)
                    tokens[way].append(sum(sum(e.trajectory["loss_mask"]) for e in episodes))
        plain = statistics.median(times["plain"]) / args.turns
        print(f"{'way':8} {'s/round':>8} {'s/turn':>8} {'vs plain':>10} {'sampled tokens':>15}")
        for way in ways:
            per_turn = statistics.median(times[way]) / args.turns
            print(
                f"{way:8} {statistics.median(times[way]):8.3f} {per_turn:8.3f} "
                f"{(per_turn - plain) * 1000:+8.1f}ms {statistics.median(tokens[way]):15.0f}"
            )
        for h in hosts.values():
            h.close()
        pool.close()

        steps = args.turns * 50
        hop: dict[str, list[float]] = {"plain": [], "class": [], "server": []}
        for _ in range(50):
            env = Plain()
            env.reset(records[0])
            for _ in range(args.turns):
                t0 = time.perf_counter()
                env.step("dcba")
                hop["plain"].append(time.perf_counter() - t0)
        opening: dict[str, list[float]] = {"class": [], "server": []}
        for way in ("class", "server"):
            ref = parse_openenv(ways[way])
            for _ in range(50):
                t0 = time.perf_counter()
                s = LocalSession(Fixed, Reply, ref) if way == "class" else ServerSession(ref, 60.0)
                s.open()
                s.reset(prompt="abcd=")
                s.tools()
                opened = time.perf_counter() - t0
                for _ in range(args.turns):
                    t0 = time.perf_counter()
                    s.step({"text": "dcba"})
                    hop[way].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                s.close()
                opening[way].append(opened + time.perf_counter() - t0)
        print(f"one step of the environment alone (median of {steps}): " + ", ".join(
            f"{w} {statistics.median(v) * 1000:.3f} ms" for w, v in hop.items()))  # fmt: skip
        print("a session's open, reset, tools/list and close (median of 50): " + ", ".join(
            f"{w} {statistics.median(v) * 1000:.2f} ms" for w, v in opening.items()))  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
