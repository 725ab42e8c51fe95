"""Named variants of the algorithm (advantage estimators, KL estimators, policy losses) in small
registries: a decorator adds a function under a name (and aliases), a lookup returns it, and an
unknown name raises with the list of valid ones. The config's choices are the registries' names.

    ADV_ESTIMATORS = Registry("adv_estimator")

    @ADV_ESTIMATORS.register("grpo")
    def _grpo(token_level_rewards, response_mask, **ctx): ...

    ADV_ESTIMATORS.get("grpo")(rewards, mask, index=index)
"""

from __future__ import annotations

from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)


class Registry:
    def __init__(self, kind: str):
        self.kind = kind
        self._fns: dict[str, Callable] = {}
        self._aliases: dict[str, str] = {}

    def register(self, name: str, *aliases: str) -> Callable[[F], F]:
        def add(fn: F) -> F:
            for n in (name, *aliases):
                if n in self._fns or n in self._aliases:
                    raise ValueError(f"{self.kind} {n!r} is registered twice")
            self._fns[name] = fn
            self._aliases.update({a: name for a in aliases})
            return fn

        return add

    def canonical(self, name: str) -> str:
        """The registered name behind `name` (itself or the name it is an alias of)."""
        name = self._aliases.get(name, name)
        if name not in self._fns:
            raise ValueError(f"unknown {self.kind} {name!r}; valid: {', '.join(self.choices())}")
        return name

    def get(self, name: str) -> Callable:
        return self._fns[self.canonical(name)]

    def names(self) -> tuple[str, ...]:
        """Registered names, in registration order (aliases excluded)."""
        return tuple(self._fns)

    def choices(self) -> tuple[str, ...]:
        """Every accepted name: the registered names, then the aliases."""
        return tuple(self._fns) + tuple(self._aliases)

    def __contains__(self, name: str) -> bool:
        return name in self._fns or name in self._aliases
