"""One OpenEnv session's environment, as `OpenEnvAgent` (agents/openenv.py) drives it: on a
server, its own WebSocket (`ServerSession`, through openenv-core's client with its errors as data:
the code the server sent is `EnvError`, no answer `EnvGone`), or an instance of an Environment
class in this process (`LocalSession`, called as OpenEnv's server calls it; `load_class` finds the
class and its Action class). Both offer the same five calls: open, reset, step, tools (MCP's
tools/list), call (tools/call, the result as the tool message's text: `tool_text`), close.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import typing
from typing import Any

from ..common.userfn import load_function
from .openenv_ref import OpenEnvRef

log = logging.getLogger("services.agents.openenv")  # one logger for the OpenEnv sessions and their agent


class EnvError(Exception):
    """The environment answered an error: `code` (OpenEnv's, e.g. EXECUTION_ERROR) and its message."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{message} ({code})")
        self.code = code


class EnvGone(Exception):
    """The connection closed (or never opened) with no answer."""


def tool_text(result: Any) -> str:
    """An MCP tool's result (fastmcp's CallToolResult, or it as JSON) as the tool message's text:
    its text contents, else its data as JSON."""

    def get(key):
        return result.get(key) if isinstance(result, dict) else getattr(result, key, None)

    if result is None or isinstance(result, (str, int, float)):
        return "" if result is None else str(result)
    texts = []
    for c in get("content") or []:
        text = c.get("text") if isinstance(c, dict) else getattr(c, "text", None)
        if isinstance(text, str):
            texts.append(text)
    if texts:
        return "\n".join(texts)
    data = get("structured_content") or get("data")
    return data if isinstance(data, str) else json.dumps(data, default=str)


@functools.cache
def client_class() -> type:
    """openenv-core's WebSocket client (`GenericEnvClient`), its errors as data (the code the
    server sent, `EnvError`; no answer, `EnvGone`), and no proxy for a server on loopback (its own
    `connect` sets NO_PROXY for the whole process, which threads race)."""
    from openenv.core.generic_client import GenericEnvClient
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    class Client(GenericEnvClient):
        where = "the OpenEnv server"

        def connect(self):
            if self._ws is None:
                host = self._ws_url.split("//", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0].strip("[]")
                loopback = host in ("localhost", "::1") or host.startswith("127.")
                try:
                    self._ws = connect(
                        self._ws_url,
                        open_timeout=self._connect_timeout,
                        proxy=None if loopback else True,
                        max_size=16 << 20,
                        legacy=True,
                    )
                except Exception as e:
                    raise EnvGone(f"{self.where} did not answer: {type(e).__name__}: {e}") from None
            return self

        def _send_and_receive(self, message: dict) -> dict:
            try:
                self._send(message)
            except ConnectionClosed:
                pass  # a server that refused the session closed it; what it said is still to read
            try:
                response = self._receive()
            except ConnectionClosed as e:
                raise EnvGone(f"{self.where} closed the session's connection: {e}") from None
            if response.get("type") == "error":
                data = response.get("data") or {}
                raise EnvError(str(data.get("code", "UNKNOWN")), str(data.get("message", data)))
            return response

    return Client


class ServerSession:
    """A session on an OpenEnv server: its own WebSocket (openenv-core's client)."""

    def __init__(self, ref: OpenEnvRef, timeout_s: float):
        self.client = client_class()(ref.url, connect_timeout_s=10.0, message_timeout_s=timeout_s)
        self.client.where = ref.where
        self.ref = ref

    def open(self) -> None:
        self.client.connect()

    def reset(self, **kwargs) -> dict:
        return self.client._send_and_receive({"type": "reset", "data": kwargs})["data"]

    def step(self, action: dict) -> dict:
        return self.client._send_and_receive({"type": "step", "data": action})["data"]

    def _mcp(self, method: str, params: dict | None = None) -> dict:
        request = {"jsonrpc": "2.0", "method": method, "id": 1, **({"params": params} if params else {})}
        return self.client._send_and_receive({"type": "mcp", "data": request}).get("data") or {}

    def tools(self) -> list:
        answer = self._mcp("tools/list")
        return [] if "error" in answer else (answer.get("result") or {}).get("tools") or []

    def call(self, name: str, arguments: dict) -> str:
        answer = self._mcp("tools/call", {"name": name, "arguments": arguments})
        if "error" in answer:
            return f"error: {(answer['error'] or {}).get('message', answer['error'])}"
        return tool_text(answer.get("result"))

    def close(self) -> None:
        self.client.disconnect()


class LocalSession:
    """A session of an OpenEnv Environment class in this process: an instance of its own, called
    as OpenEnv's server calls it (reset's kwargs those it takes, the action validated into its
    Action class, the observation serialized)."""

    def __init__(self, cls: type, action_cls: Any, ref: OpenEnvRef):
        self.cls, self.action_cls, self.ref = cls, action_cls, ref
        self.env: Any = None

    def open(self) -> None:
        try:
            self.env = self.cls()
        except Exception as e:
            raise EnvError("FACTORY_ERROR", f"{self.cls.__name__}() raised {type(e).__name__}: {e}") from None

    def _call(self, what: str, fn, *args, **kwargs):
        from openenv.core.env_server.serialization import serialize_observation

        try:
            return serialize_observation(fn(*args, **kwargs))
        except Exception as e:
            raise EnvError("EXECUTION_ERROR", f"{what} raised {type(e).__name__}: {e}") from None

    def reset(self, **kwargs) -> dict:
        params = inspect.signature(self.env.reset).parameters.values()
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            names = {p.name for p in params}
            kwargs = {k: v for k, v in kwargs.items() if k in names}
        return self._call("reset", self.env.reset, **kwargs)

    def step(self, action: dict) -> dict:
        try:
            act = self.action_cls.model_validate(action)
        except Exception as e:
            raise EnvError("VALIDATION_ERROR", f"{action!r} is no {self.action_cls.__name__}: {e}") from None
        return self._call("step", self.env.step, act)

    def tools(self) -> list:
        from openenv.core.env_server.mcp_environment import MCPEnvironment
        from openenv.core.env_server.mcp_types import ListToolsAction

        if not isinstance(self.env, MCPEnvironment):
            return []
        return [t.model_dump() for t in self.env.step(ListToolsAction()).tools]

    def call(self, name: str, arguments: dict) -> str:
        from openenv.core.env_server.mcp_types import CallToolAction

        obs = self.env.step(CallToolAction(tool_name=name, arguments=arguments))
        return f"error: {obs.error.message}" if obs.error is not None else tool_text(obs.result)

    def close(self) -> None:
        if self.env is not None:
            try:
                self.env.close()
            except Exception as e:  # the episode's outcome stands
                log.warning("%s: close() raised %s: %s", self.cls.__name__, type(e).__name__, e)


def action_class(cls: type) -> type | None:
    """The Action class an OpenEnv Environment class takes: its step's (or an MCPEnvironment's
    _step_impl's) annotation, else its generic base's first argument (Environment[MyAction, ...])."""
    from openenv.core.env_server.types import Action

    def an_action(t) -> bool:
        return isinstance(t, type) and issubclass(t, Action) and t is not Action

    for name in ("step", "_step_impl"):
        fn = getattr(cls, name, None)
        try:
            hint = typing.get_type_hints(fn).get("action") if fn is not None else None
        except Exception:
            hint = None
        if an_action(hint):
            return hint
    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if args and an_action(args[0]):
                return args[0]
    return None


def load_class(ref: OpenEnvRef) -> tuple[type, Any]:
    """The Environment class `ref` names and its Action class; ValueError saying why not."""
    from openenv.core.env_server.interfaces import Environment

    assert ref.cls is not None
    cls = load_function(ref.cls)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(
            f"{ref.cls!r} is not an OpenEnv Environment class (openenv.core.env_server.interfaces.Environment); "
            "a plain class with reset(sample) and step(reply) is named without 'openenv:'"
        )
    if not getattr(cls, "SUPPORTS_CONCURRENT_SESSIONS", False):
        raise ValueError(
            f"{cls.__name__} does not say SUPPORTS_CONCURRENT_SESSIONS = True: its sessions run many at once "
            "here (an instance each), which OpenEnv allows only for a class that says so (its server "
            "refuses max_concurrent_envs > 1 without it); set it on the class if its instances share nothing"
        )
    action_cls = action_class(cls)
    if action_cls is None:
        raise ValueError(
            f"{cls.__name__}: its Action class cannot be told: annotate step(self, action: MyAction, ...) "
            "or subclass Environment[MyAction, MyObservation, State]"
        )
    return cls, action_cls
