"""An OpenEnv environment named in `rollout.environment` (agents/openenv.py plays it):

    openenv+http://HOST:PORT[/PATH][?OPTIONS]     a running OpenEnv server (also https, ws, wss)
    openenv:path/to/env.py:Class[?OPTIONS]        an OpenEnv Environment class, run in this process
    openenv:package.module:Class[?OPTIONS]

OPTIONS are KEY=VALUE joined by `&`:

    observation=FIELD        the observation's field that is the user's message (default: its one
                             text field, else the observation as JSON)
    action=FIELD             the action's field the policy's reply fills (default: its one text field)
    adapter=FILE.py:fn       fn(reply, observation) -> the action as a dict, for an action that is
                             not one text field (or module:fn)
    max_tokens=N             each reply's limit (as an environment's `max_tokens`)

Checked when a config loads (the syntax only: nothing is imported or contacted here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, TypeGuard
from urllib.parse import parse_qsl, urlsplit

SCHEMES = {"http": "http", "https": "https", "ws": "http", "wss": "https"}  # -> the server's HTTP base
OPTIONS = ("observation", "action", "adapter", "max_tokens")


@dataclass(frozen=True)
class OpenEnvRef:
    """A parsed `openenv...` reference: `url` (the server's HTTP base URL) or `cls` (the class's
    reference, `file.py:Class` or `module:Class`), and the options."""

    ref: str
    url: Optional[str] = None
    cls: Optional[str] = None
    observation: Optional[str] = None
    action: Optional[str] = None
    adapter: Optional[str] = None
    max_tokens: Optional[int] = None

    @property
    def where(self) -> str:
        """How messages name it: the server's URL or the class."""
        return f"the OpenEnv server at {self.url}" if self.url else f"the OpenEnv environment {self.cls}"


def is_openenv(ref: Optional[str]) -> TypeGuard[str]:
    return isinstance(ref, str) and ref.startswith(("openenv:", "openenv+"))


def parse_openenv(ref: str) -> OpenEnvRef:
    """The reference's parts; ValueError saying what is wrong with it."""
    head, _, query = ref.partition("?")
    options: dict = {}
    for key, value in parse_qsl(query, keep_blank_values=True, strict_parsing=False) if query else []:
        if key not in OPTIONS:
            raise ValueError(f"{ref!r}: unknown option {key!r}; the options are {', '.join(OPTIONS)}")
        if not value:
            raise ValueError(f"{ref!r}: option {key!r} has no value")
        options[key] = value
    if "max_tokens" in options:
        try:
            options["max_tokens"] = int(options["max_tokens"])
        except ValueError:
            raise ValueError(f"{ref!r}: max_tokens={options['max_tokens']!r} is not a whole number") from None
        if options["max_tokens"] < 1:
            raise ValueError(f"{ref!r}: max_tokens must be at least 1")
    if "adapter" in options and ":" not in options["adapter"]:
        raise ValueError(f"{ref!r}: adapter={options['adapter']!r}: give 'path/to/file.py:fn' or 'module:fn'")
    if "adapter" in options and "action" in options:
        raise ValueError(f"{ref!r}: give action=FIELD or adapter=fn, not both (the adapter builds the whole action)")
    if head.startswith("openenv+"):
        parts = urlsplit(head[len("openenv+") :])
        if parts.scheme not in SCHEMES or not parts.hostname:
            raise ValueError(
                f"{ref!r}: an OpenEnv server is openenv+http://HOST:PORT (or +https, +ws, +wss), "
                "e.g. openenv+http://127.0.0.1:8000"
            )
        try:
            parts.port
        except ValueError as e:
            raise ValueError(f"{ref!r}: {e}") from None
        url = f"{SCHEMES[parts.scheme]}://{parts.netloc}{parts.path.rstrip('/')}"
        return OpenEnvRef(ref, url=url, **options)
    target, _, attr = head[len("openenv:") :].rpartition(":")
    if not target or not attr:
        raise ValueError(
            f"{ref!r}: an OpenEnv class is openenv:path/to/env.py:Class or openenv:package.module:Class; "
            "a server is openenv+http://HOST:PORT"
        )
    return OpenEnvRef(ref, cls=f"{target}:{attr}", **options)
