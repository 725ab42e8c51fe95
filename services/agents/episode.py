"""One episode loop for every environment played turn by turn (your reset/step class, gym_env.py;
an OpenEnv environment, openenv.py): the policy's reply through the session's endpoint, the
environment's step on it, its message back into the conversation, until the episode is done,
`max_turns` replies were given, or the endpoint says the session's budget is spent (the episode
ends there, truncated, with the rewards so far).

    play(client, messages, step, max_turns, request, tool_turn)
      chat completion             through the endpoint (token-exact, the environment's tokens masked)
      tool_turn(said)             a reply that calls tools: the calls' results as messages (no step)
      step(reply) -> Step         the environment's answer: a reward (or none), done, the next message
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from .protocol import budget_spent


@dataclass(frozen=True)
class Step:
    """The environment's answer to one reply: its `reward` (None: it gave none), whether the
    episode is `done`, and the `message` that goes back to the policy (none: the episode ends)."""

    reward: Optional[float]
    done: bool
    message: Optional[dict] = None


@dataclass(frozen=True)
class Played:
    """An episode's outcome: the sum of its steps' rewards, whether any step gave one, how many steps."""

    total: float
    scored: bool
    steps: int


def play(
    client,
    messages: list[dict],
    step: Callable[[str], Step],
    max_turns: int,
    request: Optional[dict] = None,
    tool_turn: Optional[Callable[[object], list[dict]]] = None,
) -> Played:
    """The turns of one episode from `messages` (the conversation so far, extended in place).
    `request`: more of each chat completion's arguments (max_tokens, tools); `tool_turn`: what a
    reply calling tools adds to the conversation instead of a step."""
    import openai

    total, scored, steps = 0.0, False, 0
    for _ in range(max_turns):
        try:
            answer = client.chat.completions.create(model="policy", messages=messages, **(request or {}))
        except openai.BadRequestError as e:
            if budget_spent(e):
                break
            raise
        said = answer.choices[0].message
        if tool_turn is not None and said.tool_calls:
            messages += tool_turn(said)
            continue
        reply = said.content or ""
        steps += 1
        result = step(reply)
        if result.reward is not None:
            total, scored = total + float(result.reward), True
        if result.done or result.message is None:
            break
        messages += [{"role": "assistant", "content": reply}, result.message]
    return Played(total, scored, steps)
