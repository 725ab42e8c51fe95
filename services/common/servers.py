"""Which generation server to call, and what to do when a call fails: the one place that
decides it for the rollout workers, the gateway's sessions and the learner's eval (and, the pool
alone, for the learner's weight pushes).

- `ServerPool`: the live servers of the registry, one picked round robin preferring those at a
  policy version, a server that just failed avoided for a while, one cached client per address.
- `RetryPolicy` (data): how a caller goes through the servers for one piece of work: which
  server next, how long a failed one is avoided (by `Fault`, what the failure says about it), how
  long to wait between tries, how many tries.
- `Tries`: the tries of one piece of work under a policy, as a loop the caller writes:

    tries = Tries(pool, policy, policy_version, stop_event)
    for address in tries:                      # the next server (None: none to be had now)
        try:
            return call(pool.client(address))
        except grpc.RpcError:
            tries.failed(address, Fault.FAILED)  # avoided as the policy says, then the wait
    ...                                        # every try failed: the caller says so its own way

What a failure *is* (a bad request, a bug in the user's code, a server at fault) stays the
caller's to decide: it knows its calls; the policy only says what each `Fault` costs the server.

A generation server killed mid-run, hop by hop (docs/architecture.md, section 12):
    rollout/sampling.py:ServerSampler.sample    its Generate fails: Tries.failed(address, Fault.FAILED)
      ServerPool.avoid                         left out for a while; the next try picks another
    learner/run.py:LearnerLoop.evaluate        the eval skips it the same way (ServerPool.wait_for)
    agents/turns.py:TurnSampler.generate       a session goes on on another server, each tried once
    generation/registration.py                 restarted, its heartbeat puts it back in every pool
"""

from __future__ import annotations

import enum
import itertools
import threading
import time
from dataclasses import dataclass
from typing import Callable, Generic, Iterator, Protocol, TypeVar

BEHIND_PAUSE_S = 0.05  # after a server answered from an older policy: the next try comes this soon


class Closable(Protocol):
    def close(self) -> None: ...


C = TypeVar("C", bound=Closable)


class ServerPool(Generic[C]):
    """The one answer to "which generation server do I call?": the live servers of the registry
    (`live()`: address -> its entry, re-read when older than `refresh_s`), one picked round robin
    preferring those at a policy version, a server that just failed avoided for a while, and one
    client per address (`connect(address)`, kept until `close`).

    `clock` (monotonic seconds) times the avoidance; a test may move it."""

    def __init__(
        self,
        live: Callable[[], dict[str, dict]],
        connect: Callable[[str], C],
        refresh_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._read, self.connect, self.refresh_s, self.clock = live, connect, refresh_s, clock
        self._servers: dict[str, dict] = {}
        self._read_at: float | None = None  # when the registry was last read (`clock`)
        self._avoided: dict[str, float] = {}  # address -> until when (`clock`)
        self._clients: dict[str, C] = {}
        self._turn = itertools.count()
        self._lock = threading.Lock()

    @classmethod
    def fixed(cls, address: str, connect: Callable[[str], C]) -> "ServerPool[C]":
        """A pool of the one server at `address` (no registry: a configured server, an eval's own)."""
        return cls(lambda: {address: {}}, connect, refresh_s=3600.0)

    def live(self, fresh: bool = False) -> dict[str, dict]:
        """The registry's live generation servers (address -> entry, with its `policy_version`): read
        again when `fresh` or older than `refresh_s`."""
        with self._lock:
            return dict(self._live(fresh))

    def _live(self, fresh: bool) -> dict[str, dict]:
        now = self.clock()
        if fresh or self._read_at is None or now - self._read_at > self.refresh_s:
            self._servers, self._read_at = self._read(), now
        return self._servers

    def pick(self, policy_version: int = 0, only_at_version: bool = False) -> str | None:
        """A live server not avoided now, round robin: one the registry shows at `policy_version` or
        newer if any (re-reading the registry before settling for an older one), else, unless
        `only_at_version`, any (its answer's version is the final word). None when there is none."""
        with self._lock:
            now = self.clock()
            for fresh in (False, True):
                servers = self._live(fresh)
                usable = sorted(a for a in servers if self._avoided.get(a, 0) <= now)
                current = [a for a in usable if servers[a].get("policy_version", 0) >= policy_version]
                if current:
                    break
            candidates = current if (current or only_at_version) else usable
            return candidates[next(self._turn) % len(candidates)] if candidates else None

    def avoid(self, address: str, seconds: float) -> None:
        """Leave `address` out of `pick` for `seconds`; the registry is read again at the next pick."""
        with self._lock:
            self._avoided[address] = self.clock() + seconds
            self._read_at = None

    def restore(self, address: str) -> None:
        """`address` answers again: `pick` may give it at once, whatever its avoidance had left."""
        with self._lock:
            self._avoided.pop(address, None)

    def avoided(self) -> dict[str, float]:
        """The servers `pick` leaves out now: address -> seconds left."""
        with self._lock:
            now = self.clock()
            return {a: until - now for a, until in self._avoided.items() if until > now}

    def client(self, address: str) -> C:
        with self._lock:
            if address not in self._clients:
                self._clients[address] = self.connect(address)
            return self._clients[address]

    def wait_for(
        self,
        policy_version: int,
        timeout_s: float | None,
        stop: threading.Event,
        on_tick: Callable[[], None] = lambda: None,
    ) -> str | None:
        """A server at `policy_version` or newer (`pick(policy_version, only_at_version=True)`), waiting for
        one up to `timeout_s` (None: until `stop` is set), calling `on_tick` at each look; None
        when the time is up or `stop` is set."""
        deadline = None if timeout_s is None else self.clock() + timeout_s
        while True:
            address = self.pick(policy_version, only_at_version=True)
            if address is not None:
                return address
            if (deadline is not None and self.clock() > deadline) or stop.is_set():
                return None
            on_tick()
            stop.wait(0.2)  # the next pick reads the registry again (none was at the version)

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()


class Fault(enum.Enum):
    """What a failed try says about the server it ran on: how long `Tries.failed` avoids it."""

    FAILED = "failed"  # it failed the call (unavailable, past its deadline, gone): `avoid_s`
    REFUSED = "refused"  # it refused the request as a whole (its limits differ from the caller's): `refused_s`
    BEHIND = "behind"  # it answered from an older policy than asked (it missed a push): `behind_s`
    ELSEWHERE = "elsewhere"  # another service failed the try: the server is not avoided


@dataclass(frozen=True)
class RetryPolicy:
    """How one caller goes through the generation servers for one piece of work.

    `tries`: tries in all, those that found no server included (None: no limit; `each_once` or
    the caller ends it). `backoff_s`: the wait after a try that failed, doubled at each try up to
    `max_backoff_s` (None: not doubled). How long a failed server is left out of the picks:
    `avoid_s` (None: the try's backoff), `refused_s`, `behind_s` (by `Fault`). `only_at_version`:
    only a server at the version, waited for up to `wait_s` (None: until stopped); else any live
    one, preferring those at it. `each_once`: a server that failed a try is not tried again."""

    tries: int | None = None
    backoff_s: float = 0.0
    max_backoff_s: float | None = None
    avoid_s: float | None = None
    refused_s: float = 0.0
    behind_s: float = 0.0
    only_at_version: bool = False
    wait_s: float | None = None
    each_once: bool = False


class Tries(Generic[C]):
    """The tries of one piece of work over `pool` under `policy`: iterating gives each try's
    server (None: none to be had now; the caller decides whether to go on), the first one `first`
    when given (a session's own server); after a try that failed, `failed(address, fault)` avoids
    that server as the fault says and waits before the next. `attempt`: the try now (0-based);
    `on_tick` is called at each look while waiting for a server at the version."""

    def __init__(
        self,
        pool: ServerPool[C],
        policy: RetryPolicy,
        policy_version: int = 0,
        stop: threading.Event | None = None,
        first: str | None = None,
        on_tick: Callable[[], None] = lambda: None,
    ):
        self.pool, self.policy, self.policy_version, self.first, self.on_tick = (
            pool,
            policy,
            policy_version,
            first,
            on_tick,
        )
        self.stop = stop if stop is not None else threading.Event()
        self.attempt = 0
        self.tried: set[str] = set()

    def __iter__(self) -> Iterator[str | None]:
        attempts = itertools.count() if self.policy.tries is None else range(self.policy.tries)
        for self.attempt in attempts:
            yield self._next()

    def _next(self) -> str | None:
        if self.attempt == 0 and self.first is not None:
            return self.first
        p = self.policy
        if p.only_at_version:
            address = self.pool.wait_for(self.policy_version, p.wait_s, self.stop, on_tick=self.on_tick)
        else:
            address = self.pool.pick(self.policy_version)
        return None if p.each_once and address in self.tried else address

    @property
    def backoff_s(self) -> float:
        """The wait after this try, when it fails."""
        p = self.policy
        return p.backoff_s if p.max_backoff_s is None else min(p.backoff_s * 2**self.attempt, p.max_backoff_s)

    def failed(self, address: str | None, fault: Fault = Fault.FAILED) -> None:
        """This try on `address` failed (None: it found no server): that server avoided as `fault`
        says, then the wait before the next try (the backoff; after `Fault.BEHIND`, a moment)."""
        if address is not None:
            self.tried.add(address)
            avoid_s = self._avoid_s(fault)
            if avoid_s is not None:
                self.pool.avoid(address, avoid_s)
        self.stop.wait(BEHIND_PAUSE_S if fault is Fault.BEHIND else self.backoff_s)

    def _avoid_s(self, fault: Fault) -> float | None:
        p = self.policy
        if fault is Fault.FAILED:
            return self.backoff_s if p.avoid_s is None else p.avoid_s
        return {Fault.REFUSED: p.refused_s, Fault.BEHIND: p.behind_s}.get(fault)
