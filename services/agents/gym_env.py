"""Your own environment, written gym-like, as the agent of a session (`rollout.environment:
path/to/env.py:MyEnv` or `module.path:MyEnv`: the registry's kind for a reference of no other
kind, common/environments.py):

    env = MyEnv()                             # your class (or a factory), once per session
    first = env.reset(sample)                 # the first user message: a str, or a list of messages
    message, reward, done = env.step(reply)   # after each reply of the policy (its text)
"""

from __future__ import annotations

from typing import Callable

from ..common.userfn import load_function
from .episode import Step, play


# ------------------------------------------------ the kind's parts (common/environments.py asks them)
def check(ref: str) -> None:
    """A Python reference's syntax: `path/to/file.py:Name` or `module.path:Name` (whether it
    loads is the pre-flight's)."""
    target, _, attr = ref.rpartition(":")
    if not target or not attr:
        raise ValueError(
            f"{ref!r}: give 'path/to/file.py:Class' or 'module.path:Class' (your reset/step environment), "
            "or a reference of another kind"
        )


def agent(ref: str, rc) -> Callable:
    """The agent of a session of your environment, at most `rollout.max_turns` replies."""
    return environment_agent(load_function(ref), rc.max_turns)


def environment_agent(make_env: Callable, max_turns: int) -> Callable:
    """An agent that plays an environment written gym-like:

        env = make_env()                       # your class (or a factory), once per session
        first = env.reset(sample)              # the first user message: a str, or a list of messages
        message, reward, done = env.step(reply)  # after each reply of the policy (its text)

    `message` (a str: the user's; or a dict such as {"role": "tool", "content": ...}) goes into the
    conversation; the session's reward is the sum of the steps' rewards. After `max_turns` replies
    without `done`, or when the session's tokens (response_length) are spent, the episode ends
    there (truncated) with the rewards so far. An environment's `max_tokens` attribute, if it has
    one, bounds each reply."""

    def run(client, sample) -> float:
        env = make_env()
        first = env.reset(sample)
        messages = [{"role": "user", "content": first}] if isinstance(first, str) else list(first)
        limit = {"max_tokens": env.max_tokens} if getattr(env, "max_tokens", None) else {}

        def step(reply: str) -> Step:
            message, reward, done = env.step(reply)
            said = None if done else {"role": "user", "content": message} if isinstance(message, str) else dict(message)
            return Step(float(reward), bool(done), said)

        return play(client, messages, step, max_turns, limit).total

    return run
