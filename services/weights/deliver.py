"""A version delivered to every server at once (`Rounds`, for `Publisher.deliver`): a first round
by each server's planned `Route`, every stream and load running at once (a `Fanout` needs all its
readers reading), then a second that streams what the first could not deliver (a load refused
from shared memory; a delta refused for its base, streamed whole); each server's `Outcome`."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from .protocol import PushKind
from .transports import Delivery, Job, SharedMemoryTransport, StreamTransport

# one server's job run, then what follows it (`Publisher._settled`: its registration if it took the version)
Settle = Callable[[Job, str, dict, int, PushKind, str], Delivery]


@dataclass(frozen=True)
class Route:
    """How one server gets a version: the payload `kind` and the transport `via` ("shm" or "grpc")."""

    kind: PushKind
    via: str


@dataclass(frozen=True)
class Outcome:
    """What became of one server's push (`delivery`), the transport that carried it and the
    payload kind it got."""

    delivery: Delivery
    via: str
    kind: PushKind

    @property
    def took(self) -> bool:
        return self.delivery in (Delivery.TOOK, Delivery.HELD)


class Rounds:
    """Version `policy_version` (`payloads`: kind -> state) delivered to `servers` (address -> its
    registry entry) as `plan` says, by the transports `stream` and `shared`; each server's job is
    run through `settle`. A DELTA is against `delta_base` (its policy_version, its state)."""

    def __init__(
        self,
        stream: StreamTransport,
        shared: SharedMemoryTransport,
        servers: dict,
        plan: dict[str, Route],
        payloads: dict,
        policy_version: int,
        delta_base: tuple[int, dict] | None,
        settle: Settle,
    ):
        self.stream, self.shared, self.servers, self.plan = stream, shared, servers, plan
        self.payloads, self.policy_version, self.delta_base, self.settle = payloads, policy_version, delta_base, settle

    def run(self) -> dict[str, Outcome]:
        """Both rounds: each server's `Outcome`."""
        groups: dict[Route, list[str]] = {}
        for a, route in self.plan.items():
            groups.setdefault(route, []).append(a)
        ok: dict[str, Outcome] = {}
        # every server's stream or load runs at once (a Fanout needs all its readers reading)
        try:
            with ThreadPoolExecutor(max_workers=max(1, 2 * len(self.servers))) as pool:
                futures, shared = self._first(pool, groups)
                retry: dict[PushKind, list[str]] = {}
                for a, f in futures.items():
                    result = f.result()
                    if result is Delivery.STREAM_INSTEAD:
                        retry.setdefault(self.plan[a].kind, []).append(a)
                    elif result is Delivery.FULL_INSTEAD:
                        retry.setdefault(PushKind.FULL, []).append(a)
                    ok[a] = Outcome(result, self.shared.name if a in shared else self.stream.name, self.plan[a].kind)
                for kind, targets in retry.items():  # the second round
                    again = self._stream(pool, targets, kind)
                    ok.update({a: Outcome(f.result(), self.stream.name, kind) for a, f in again.items()})
        finally:
            self.stream.finish()
        return ok

    def _first(self, pool: ThreadPoolExecutor, groups: dict[Route, list[str]]) -> tuple[dict, set[str]]:
        """The first round, started: every stream, then every shared-memory load (streamed when its
        file cannot be written); {address: its future} and the addresses loading from shared memory."""
        futures: dict = {}
        shared: set[str] = set()
        for route, targets in groups.items():
            if route.via == self.stream.name:
                futures.update(self._stream(pool, targets, route.kind))
        for route, targets in groups.items():
            if route.via == self.shared.name:
                loads = self.shared.jobs(targets, self.payloads[route.kind], route.kind, self.policy_version)
                if loads is None:
                    futures.update(self._stream(pool, targets, route.kind))
                else:
                    shared.update(loads)
                    futures.update(self._run(pool, loads, route.kind, self.shared.name))
        return futures, shared

    def _run(self, pool: ThreadPoolExecutor, jobs: dict[str, Job], kind: PushKind, via: str) -> dict:
        return {
            a: pool.submit(self.settle, job, a, self.servers[a], self.policy_version, kind, via)
            for a, job in jobs.items()
        }

    def _stream(self, pool: ThreadPoolExecutor, targets: list[str], kind: PushKind) -> dict:
        base = self.delta_base if kind is PushKind.DELTA else None
        jobs = self.stream.jobs(targets, self.payloads[kind], kind, self.policy_version, base=base)
        return self._run(pool, jobs, kind, self.stream.name)
