"""OpenEnv environments as the agent of a session (`rollout.environment: openenv...`,
openenv_ref.py: the syntax): a running OpenEnv server (`openenv+http://HOST:PORT`), one
WebSocket per session, or an OpenEnv `Environment` class run in this process
(`openenv:path/to/env.py:MyEnvironment`), one instance per session. Many sessions at once, as
AgentHost runs them (a thread each).

The hops of one session (`openenv_agent`'s `run`; the session's environment, on a server or in
this process, is agents/openenv_sessions.py):
    open        a WebSocket /ws of the server (openenv-core's own client, `GenericEnvClient`;
                OpenEnv makes an Environment for it), or an instance of the class
    reset       seed, episode_id, prompt, label, metadata of the sample (the environment's reset
                takes those it names) -> the first observation -> the first user message
    turns       the policy's reply (a chat completion through the endpoint: token-exact, the
                environment's tokens masked) -> the action -> step -> the observation -> the next
                user message, until done, rollout.max_turns or the session's tokens; with MCP
                tools: a reply that calls them -> tools/call on the same connection -> tool messages
    close       always
The episode's reward is the sum of its steps' rewards (null ones left out); an episode with none
is `Unscored`, never 0.

What ends a session without a reward: the server unreachable or full (its max_concurrent_envs
taken) is `EnvironmentDown`, an Outage (the prompt stays pending); the environment's error
(reset or step raised, an action it refused) is `AgentFailed` with its message (a dead letter).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from ..common.userfn import load_function
from .episode import Step, play
from .errors import AgentFailed, AgentServiceDown, Unscored
from .openenv_ref import OpenEnvRef, parse_openenv
from .openenv_sessions import EnvError, EnvGone, LocalSession, ServerSession, load_class

log = logging.getLogger(__name__)

ADAPTER_TAKES = ("reply", "observation")
CONCURRENCY = (
    "raise its max_concurrent_envs (create_app(..., max_concurrent_envs=N); N at least the sessions "
    "run at once: rollout.prompts_per_request x num_return_sequences_in_group per worker, "
    "x rollout.concurrency x the workers), which OpenEnv allows only for an Environment class "
    "with SUPPORTS_CONCURRENT_SESSIONS = True"
)


CAPACITY_WAIT_S = 3.0  # how long a session asks a full server again before it is an outage


class EnvironmentDown(AgentServiceDown):
    """The OpenEnv server did not answer, or is full: an outage, the prompt stays pending."""


# ------------------------------------------------------------------ how observations and replies map
@dataclass
class Shape:
    """How an observation becomes the user's message and a reply becomes the action."""

    observation: Optional[str]  # the observation's field that is the message; None: its one text field, else JSON
    action: Optional[str]  # the action's field the reply fills (when there is no adapter)
    adapter: Optional[Callable]  # adapter(reply, observation) -> the action as a dict

    def message(self, observation: dict) -> str:
        if self.observation is not None:
            if self.observation not in observation:
                raise AgentFailed(f"the observation has no field {self.observation!r}: it has {sorted(observation)}")
            value = observation[self.observation]
            return value if isinstance(value, str) else json.dumps(value)
        texts = [v for v in observation.values() if isinstance(v, str)]
        return texts[0] if len(texts) == 1 else json.dumps(observation)

    def action_of(self, reply: str, observation: dict) -> dict:
        if self.adapter is None:
            return {self.action: reply}
        try:
            action = self.adapter(reply, observation)
        except Exception as e:
            raise AgentFailed(f"the action adapter raised {type(e).__name__}: {e}") from None
        if hasattr(action, "model_dump"):  # the environment's Action itself
            action = action.model_dump(exclude={"metadata"})
        if not isinstance(action, dict):
            raise AgentFailed(f"the action adapter returned {type(action).__name__}, not a dict (the action's fields)")
        return action


def text_field(schema: dict, where: str) -> str:
    """The action's field a reply fills, from its JSON schema: its one text field (of those
    other than `metadata`), or among several the one it requires; ValueError saying what to give
    instead."""
    props = {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}
    required = [k for k in schema.get("required") or [] if k in props]

    def is_text(p: dict) -> bool:
        return p.get("type") == "string" or any(o.get("type") == "string" for o in p.get("anyOf") or [])

    texts = [k for k, p in props.items() if is_text(p)]
    fits = [k for k in texts if all(r == k for r in required)]
    if len(fits) == 1:
        return fits[0]
    fields = ", ".join(f"{k}: {p.get('type', '?')}" for k, p in props.items()) or "no fields"
    raise ValueError(
        f"{where}: its action ({fields}) "
        "is not one text field the reply can fill: name the field (?action=FIELD) or give an adapter "
        "(?adapter=path/to/file.py:fn, fn(reply, observation) -> the action as a dict)"
    )


def reset_kwargs(sample) -> dict:
    """What of the sample goes to reset: the environment's reset takes those it names (all with
    **kwargs). `seed` is the prompt's metadata's `seed`, else a number from its id: the same for
    every session of the prompt (a group shares its first observation)."""
    metadata = sample.metadata or {}
    seed = metadata.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int):
        seed = int(hashlib.sha256(str(sample.id).encode()).hexdigest()[:8], 16) % (2**31)
    return {
        "seed": seed,
        "episode_id": str(sample.id),
        "prompt": sample.prompt,
        "label": sample.label,
        "metadata": metadata,
    }


def openai_tools(tools: list) -> list[dict]:
    """MCP tools (name, description, input schema) as OpenAI tools for the chat request."""
    out = []
    for t in tools:
        get = t.get if isinstance(t, dict) else lambda k, d=None, t=t: getattr(t, k, d)
        schema = get("input_schema") or get("inputSchema") or {"type": "object", "properties": {}}
        out.append(
            {
                "type": "function",
                "function": {"name": get("name"), "description": get("description") or "", "parameters": schema},
            }
        )
    return out


# ------------------------------------------------------------------ the agent
# ------------------------------------------------ the kind's parts (common/environments.py asks them)
def check(ref: str) -> None:
    """The reference's syntax (openenv_ref.py); nothing imported or contacted."""
    parse_openenv(ref)


def agent(ref: str, rc) -> Callable:
    """The agent of a session of `ref`'s environment, with the rollout section's bounds."""
    return openenv_agent(ref, rc.max_turns, rc.agent_timeout_s)


def openenv_agent(reference: str, max_turns: int, timeout_s: float) -> Callable:
    """The agent of `rollout.environment: openenv...`: `run(client, sample) -> reward`, a session
    of the environment (module docstring). ValueError, when it loads, saying why it cannot be
    played: openenv-core missing, the class or the adapter not loading, an action the reply
    cannot fill. A server is not contacted until a session runs (its action schema, read then
    when the reply fills a field named by none, is read once)."""
    ref = parse_openenv(reference)
    try:
        import openenv.core  # noqa: F401
    except ImportError:
        raise ValueError(
            "openenv-core is not installed here: pip install 'rlhf-services[envs]' (or openenv-core)"
        ) from None
    return OpenEnvAgent(ref, max_turns, timeout_s)


class OpenEnvAgent:
    """Sessions of one OpenEnv environment (`ref`), each an episode played by the policy:

    __call__            a session: the environment opened and reset, then turns until done
      _opened           open + reset (a full server asked again for a while, then an outage)
      _shape            how observations and replies map (a server's schema read once)
      _tool_turn        the policy's MCP tool calls, run on the episode's environment
      _step             the policy's reply as the action; the step's reward checked
    """

    def __init__(self, ref: OpenEnvRef, max_turns: int, timeout_s: float):
        self.ref, self.max_turns, self.timeout_s = ref, max_turns, timeout_s
        self.adapter = load_function(ref.adapter, takes=ADAPTER_TAKES) if ref.adapter else None
        self.limit = {"max_tokens": ref.max_tokens} if ref.max_tokens else {}
        self._shape_lock = threading.Lock()
        self._shapes: list[Shape] = []
        self._cls = None
        if ref.cls is not None:
            self._cls, self._action_cls = load_class(ref)
            field = (
                ref.action
                if ref.action or self.adapter
                else text_field(self._action_cls.model_json_schema(), ref.where)
            )
            self._shapes.append(Shape(ref.observation, field, self.adapter))

    def __call__(self, client, sample) -> float:
        env, first = self._opened(sample)
        try:
            how, tools = self._begin(env, first)
            return self._play(client, env, how, tools, first.get("observation") or {})
        finally:
            env.close()

    def _session(self) -> LocalSession | ServerSession:
        if self._cls is not None:
            return LocalSession(self._cls, self._action_cls, self.ref)
        return ServerSession(self.ref, self.timeout_s)

    def _opened(self, sample) -> tuple[LocalSession | ServerSession, dict]:
        """A session's environment, reset: a server that is full is asked again for a while (the
        sessions of the batch before may still be closing there), then it is an outage."""
        wait, deadline = 0.1, time.monotonic() + CAPACITY_WAIT_S
        while True:
            env = self._session()
            try:
                env.open()
                return env, env.reset(**reset_kwargs(sample))
            except EnvGone as e:
                env.close()
                raise EnvironmentDown(str(e)) from None
            except EnvError as e:
                env.close()
                if e.code != "CAPACITY_REACHED":
                    raise AgentFailed(f"{self.ref.where}: reset failed: {e}") from None
                if time.monotonic() + wait > deadline:
                    raise EnvironmentDown(f"{self.ref.where} is full: {e}; {CONCURRENCY}") from None
            time.sleep(wait)
            wait = min(2 * wait, 1.0)

    def _shape(self) -> Shape:
        """How this environment maps (a server's action schema read at its first session)."""
        with self._shape_lock:
            if not self._shapes:
                ref = self.ref
                field = (
                    ref.action if ref.action or self.adapter else text_field(server_schema(ref)["action"], ref.where)
                )
                self._shapes.append(Shape(ref.observation, field, self.adapter))
            return self._shapes[0]

    def _begin(self, env, first: dict) -> tuple[Shape, list]:
        """The episode's mapping and its MCP tools as OpenAI tools, once it is reset."""
        try:
            how = self._shape()
            tools = openai_tools(env.tools())
        except EnvGone as e:
            raise EnvironmentDown(str(e)) from None
        except EnvError as e:
            raise AgentFailed(f"{self.ref.where}: listing its MCP tools failed: {e}") from None
        except ValueError as e:  # the action schema: nothing a session can play
            raise AgentFailed(str(e)) from None
        if first.get("done"):
            raise AgentFailed(f"{self.ref.where}: the episode was over at reset")
        return how, tools

    def _play(self, client, env, how: Shape, tools: list, observation: dict) -> float:
        """The turns until the episode is done (or the session's budget is spent): the sum of
        the steps' rewards; `Unscored` when no step gave one."""
        messages: list[dict] = [{"role": "user", "content": how.message(observation)}]
        offered = {"tools": tools} if tools else {}
        seen = [observation]  # the observation the next reply answers
        steps = [0]

        def step(reply: str) -> Step:
            steps[0] += 1
            result = self._step(env, how.action_of(reply, seen[0]), steps[0])
            reward = result.get("reward")
            if result.get("done"):
                return Step(reward, True)
            seen[0] = result.get("observation") or {}
            return Step(reward, False, {"role": "user", "content": how.message(seen[0])})

        # MCP tools, on the episode's own environment
        tool_turn = (lambda said: self._tool_turn(env, said)) if tools else None
        played = play(client, messages, step, self.max_turns, {**self.limit, **offered}, tool_turn)
        if not played.scored:
            raise Unscored(
                f"{self.ref.where}: unscored: no step of the episode gave a reward ({played.steps} steps; "
                "an OpenEnv reward of null is not taken as 0)"
            )
        return played.total

    def _tool_turn(self, env, said) -> list[dict]:
        """The assistant's message with its tool calls, then each call's result as a tool message."""
        out = [said.model_dump(exclude_none=True)]
        for call in said.tool_calls:
            try:
                arguments = json.loads(call.function.arguments or "{}")
            except json.JSONDecodeError:
                arguments = None
            try:
                text = (
                    env.call(call.function.name, arguments)
                    if isinstance(arguments, dict)
                    else "error: the arguments are not a JSON object"
                )
            except EnvGone as e:
                raise EnvironmentDown(str(e)) from None
            except EnvError as e:
                raise AgentFailed(f"{self.ref.where}: tool {call.function.name} failed: {e}") from None
            out.append({"role": "tool", "tool_call_id": call.id, "content": text})
        return out

    def _step(self, env, action, steps: int) -> dict:
        """One step of the episode; its reward, when it gives one, a finite number."""
        try:
            result = env.step(action)
        except EnvGone as e:
            raise EnvironmentDown(str(e)) from None
        except EnvError as e:
            raise AgentFailed(f"{self.ref.where}: step {steps} failed: {e}") from None
        reward = result.get("reward")
        if reward is not None and (not isinstance(reward, (int, float)) or not math.isfinite(reward)):
            raise Unscored(f"{self.ref.where}: step {steps} gave the reward {reward!r}, not a finite number")
        return result


def server_schema(ref: OpenEnvRef) -> dict:
    """The server's `GET /schema` (action, observation, state); EnvGone when it does not answer."""
    import httpx

    try:
        answer = httpx.get(f"{ref.url}/schema", timeout=10.0)
    except httpx.TransportError as e:
        raise EnvGone(f"{ref.where} did not answer: {type(e).__name__}: {e}") from None
    if not answer.is_success:
        raise ValueError(f"{ref.where}: GET /schema answered {answer.status_code}: is it an OpenEnv server?")
    return answer.json()
