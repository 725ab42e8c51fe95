"""The one registry of environment kinds: what `rollout.environment` may name, and who plays it.

    openenv+http://HOST:PORT[?OPTIONS]        an OpenEnv server            (agents/openenv.py)
    openenv:FILE.py:Class[?OPTIONS]           an OpenEnv class, in process  (agents/openenv.py)
    verifiers:FILE.py:factory | verifiers:ID  a verifiers Environment       (agents/verifiers_env.py)
    FILE.py:Class | module:Class              your reset/step class         (agents/gym_env.py)

Each kind is one `EnvironmentKind`: the prefixes its references start with, their syntax (as
errors show it) and its adapter, a module of the agents' layer with three parts:

    check(ref) -> None                 the reference's syntax (ValueError saying what is wrong);
                                       nothing imported or contacted: a config load runs it
    agent(ref, rc) -> agent function   the session's agent (`rc`: the rollout section), loaded
                                       (ValueError when it does not load)
    records(ref, split, tokenizer, limit) -> list[dict] | None
                                       only for a kind that brings prompts (`source`: the name
                                       data.train / data.eval give to take them)

Config validation, the pre-flight, the agent host and the prompt loader ask this registry; none
of them knows a kind by its prefix. The adapters are plug-ins, imported by name when a reference
of their kind is met (as entry points are): this module, at the bottom layer, names them without
importing them, and loading one imports only what its own file imports (the ecosystem's package
is imported when the environment is loaded, not when a config is checked).

Adding an ecosystem: one adapter file with those parts, and one line in `KINDS` below
(docs/architecture.md, "Add an environment ecosystem")."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Optional


@dataclass(frozen=True)
class EnvironmentKind:
    """One kind of environment: `name` (how messages call it), the `prefixes` its references
    start with (none: the kind of any other reference, your own class), their `syntax`, its
    `adapter` (a module path, see the module's docstring) and, for a kind that brings prompts,
    the data `source` name that takes them."""

    name: str
    prefixes: tuple[str, ...]
    syntax: str
    adapter: str
    source: Optional[str] = None

    def module(self) -> ModuleType:
        return importlib.import_module(self.adapter)


KINDS = (
    EnvironmentKind(
        "openenv",
        ("openenv+", "openenv:"),
        "openenv+http://HOST:PORT or openenv:FILE.py:Class",
        "services.agents.openenv",
    ),
    EnvironmentKind(
        "verifiers",
        ("verifiers:",),
        "verifiers:FILE.py:load_environment or verifiers:ENV_ID",
        "services.agents.verifiers_env",
        source="verifiers",
    ),
    EnvironmentKind("python", (), "FILE.py:Class or module.path:Class", "services.agents.gym_env"),
)


def sources() -> dict[str, EnvironmentKind]:
    """The data.train / data.eval names that take an environment's prompts, and the kind of each."""
    return {k.source: k for k in KINDS if k.source}


def known() -> str:
    """Every kind's syntax, for an error message."""
    return "; ".join(f"{k.name}: {k.syntax}" for k in KINDS)


def kind_of(ref: str) -> EnvironmentKind:
    """The kind `ref` is of: the one whose prefix it starts with, else your own class; ValueError
    naming the kinds known for a reference that looks like another kind's (a scheme, `name+...`
    or `name://...`, that no kind registers)."""
    for kind in KINDS:
        if kind.prefixes and ref.startswith(kind.prefixes):
            return kind
    head = ref.split(":", 1)[0]
    if "+" in head or ref[len(head) : len(head) + 3] == "://":
        raise ValueError(f"{ref!r}: no environment kind {head!r}; the kinds are {known()}")
    return next(k for k in KINDS if not k.prefixes)


def check(ref: str) -> None:
    """The reference's syntax, by its kind (ValueError saying what is wrong)."""
    kind_of(ref).module().check(ref)


def agent(ref: str, rc) -> Callable:
    """The agent function that plays `ref`'s environment (ValueError when it does not load)."""
    return kind_of(ref).module().agent(ref, rc)


def brings_prompts(ref: Optional[str], source: str) -> bool:
    """Whether `ref` (rollout.environment) is of the kind whose prompts the data source `source` takes."""
    kinds = sources()
    return ref is not None and source in kinds and kind_of(ref) is kinds[source]


def records(ref: str, split: str, tokenizer, limit: Optional[int] = None) -> Optional[list[dict]]:
    """The prompts `ref`'s environment brings, as rows (`split`: "train" or "eval"; None: it has
    none for that split)."""
    return kind_of(ref).module().records(ref, split, tokenizer, limit)
