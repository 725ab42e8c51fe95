"""OpenEnv environments for tests/rollout/test_openenv.py, served by openenv-core's own server
framework (`create_app`, uvicorn) in a process of their own:

    python -m tests.rollout.openenv_envs      # prints "port N", then serves on 127.0.0.1:N

each at a path of its own (`openenv+http://127.0.0.1:N/reverse`):

    /reverse    examples/openenv_reverse_env.py: reverse the word, two tries (8 sessions at once)
    /tools      the same with its MCP tool `reverse` (8 at once)
    /one        the same at OpenEnv's default of one session at once
    /raises     its step raises (the simulator crashed)
    /unscored   its rewards are null
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from openenv_reverse_env import (  # noqa: E402
    ReverseAction,
    ReverseEnvironment,
    ReverseObservation,
    ReverseToolsEnvironment,
)


class Raises(ReverseEnvironment):
    def step(self, action: ReverseAction, timeout_s: Optional[float] = None, **kwargs: Any) -> ReverseObservation:
        raise RuntimeError("the simulator crashed")


class NullRewards(ReverseEnvironment):
    def step(self, action: ReverseAction, timeout_s: Optional[float] = None, **kwargs: Any) -> ReverseObservation:
        return ReverseObservation(done=True, reward=None)


ENVS = {
    "reverse": (ReverseEnvironment, 8),
    "tools": (ReverseToolsEnvironment, 8),
    "one": (ReverseEnvironment, None),  # OpenEnv's default: one session at once
    "raises": (Raises, 8),
    "unscored": (NullRewards, 8),
}


def app():
    from fastapi import FastAPI
    from openenv.core.env_server.http_server import create_app

    root = FastAPI()
    for path, (env, at_once) in ENVS.items():
        root.mount(f"/{path}", create_app(env, ReverseAction, ReverseObservation, max_concurrent_envs=at_once))
    return root


def main() -> None:
    import uvicorn

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    print(f"port {sock.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(app(), log_level="warning")).run(sockets=[sock])


if __name__ == "__main__":
    main()
