"""An OpenEnv environment (openenv-core's own server framework) for `rollout.environment`
(docs/environments.md, "OpenEnv"): the policy is asked to reverse a word ("abc=" -> "cba"), the
task the tiny model learned, and has two tries. Reward at the end: the share of the letters of
its last try that are in place (1.0 for the word reversed); the try before it gets 0.0.

The episode's word is the prompt's when the trainer passes one to `reset` (rlhf passes the
prompt's `prompt` and `label`); without one, a word drawn from `seed`. Serve it (many sessions at
once: OpenEnv's servers take one unless told more):

    python examples/openenv_reverse_env.py --port 8011 --max-concurrent-envs 16
    python examples/openenv_reverse_env.py --port 8011 --tools    # with an MCP tool, `reverse`

and name it in a config: `rollout.environment: openenv+http://127.0.0.1:8011`, or run the class
in the trainer's own process: `openenv:examples/openenv_reverse_env.py:ReverseEnvironment`.
"""

from __future__ import annotations

import argparse
import random
import string
from typing import Any, Optional

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

TRIES = 2


class ReverseAction(Action):
    text: str = Field(..., description="the reply: the word reversed")


class ReverseObservation(Observation):
    prompt: str = Field(default="", description="what the policy is asked")


class ReverseEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # each session its own instance, sharing nothing

    def __init__(self):
        super().__init__()
        self._state = State()
        self.label = ""

    def reset(
        self,
        seed: Optional[int] = None,
        episode_id: Optional[str] = None,
        prompt: Optional[str] = None,
        label: Optional[str] = None,
        **kwargs: Any,
    ) -> ReverseObservation:
        if prompt is None or label is None:  # no prompt given: a word of its own
            rng = random.Random(seed)
            word = "".join(rng.choice(string.ascii_lowercase[:8]) for _ in range(rng.randint(3, 6)))
            prompt, label = f"{word}=", word[::-1]
        self.label = label
        self._state = State(episode_id=episode_id, step_count=0)
        return ReverseObservation(prompt=prompt)

    def step(self, action: ReverseAction, timeout_s: Optional[float] = None, **kwargs: Any) -> ReverseObservation:
        self._state.step_count += 1
        got = action.text.strip()
        done = got == self.label or self._state.step_count >= TRIES
        if not done:
            return ReverseObservation(prompt="again=", reward=0.0)
        in_place = sum(a == b for a, b in zip(got, self.label)) / max(len(self.label), len(got), 1)
        return ReverseObservation(done=True, reward=in_place)

    @property
    def state(self) -> State:
        return self._state


class ReverseToolsEnvironment(MCPEnvironment):
    """The same task with an MCP tool, `reverse(text)`, that the policy may call (as an OpenAI
    tool call) before it answers."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        from fastmcp import FastMCP

        mcp = FastMCP("reverse")

        @mcp.tool()
        def reverse(text: str) -> str:
            """The text reversed."""
            return text[::-1]

        super().__init__(mcp)
        self.task = ReverseEnvironment()

    def reset(self, seed=None, episode_id=None, **kwargs: Any) -> ReverseObservation:
        return self.task.reset(seed=seed, episode_id=episode_id, **kwargs)

    def _step_impl(self, action: ReverseAction, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
        return self.task.step(action)

    @property
    def state(self) -> State:
        return self.task.state


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description="serve the reverse environment (OpenEnv)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--max-concurrent-envs", type=int, default=16, help="sessions (WebSockets) at once")
    parser.add_argument("--tools", action="store_true", help="with the MCP tool `reverse`")
    args = parser.parse_args(argv)
    env = ReverseToolsEnvironment if args.tools else ReverseEnvironment
    app = create_app(env, ReverseAction, ReverseObservation, max_concurrent_envs=args.max_concurrent_envs)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
