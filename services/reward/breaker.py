"""The reward API's circuit breaker: closed -> (a run of failed requests) open, every call failing
at once with `RewardUnavailable` ("circuit open") without reaching the API -> (after a cooldown)
half-open, one probe request let through -> closed on its success, open again on its failure.
http_scorer.py says which failures count, and how often one request body's do."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from ..common.rpc.errors import Unavailable

log = logging.getLogger("services.reward.http_scorer")  # its lines read as the scorer's, as before

CLOSED, HALF_OPEN, OPEN = "closed", "half_open", "open"


class RewardUnavailable(Unavailable):
    """No reward from the API now: it is down (circuit open) or refuses our credentials or URL.
    The reward server answers UNAVAILABLE; callers wait, as for a restarting server."""


class CircuitBreaker:
    """Closed -> (`failures` failed requests in a row) open -> (`cooldown_s` later, one request
    allowed through) half-open -> closed on its success, open again on its failure.
    `failures` 0 = never opens. `on_change(state, opened)` is told each new state (`opened`: it
    opened from closed). `clock` gives the seconds its cooldown is measured in."""

    def __init__(
        self,
        failures: int = 5,
        cooldown_s: float = 30.0,
        name: str = "reward API",
        on_change=None,
        redact=lambda s: s,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.failures, self.cooldown_s, self.name, self.clock = failures, cooldown_s, name, clock
        self.on_change, self.redact = on_change or (lambda state, opened: None), redact
        self.state, self.consecutive, self.last_error = CLOSED, 0, ""
        self.opened_at = self.down_since = 0.0  # the last (re)opening; the first opening of this outage
        self.times_opened = 0
        self._probe_out, self._probe_at = False, 0.0  # a probe lost to a bug is replaced after cooldown_s
        self._streak: set = set()  # keys of the failures counted since the last success
        self._lock = threading.Lock()

    def allow(self) -> None:
        """Returns when a request may go; raises `RewardUnavailable` while the circuit is open
        (or while the half-open probe is out)."""
        with self._lock:
            if self.state == CLOSED:
                return
            wait = self._until_probe()
            if self.state == OPEN and wait <= 0:
                self._set(HALF_OPEN)
            now = self.clock()
            if self.state == HALF_OPEN and (not self._probe_out or now - self._probe_at > self.cooldown_s):
                self._probe_out, self._probe_at = True, now  # this request is the probe
                return
            raise RewardUnavailable(self._open_message(wait))

    def open_error(self) -> RewardUnavailable | None:
        """What `allow` would raise while the circuit is not closed (without taking the probe); None
        while it is closed."""
        with self._lock:
            if self.state == CLOSED:
                return None
            return RewardUnavailable(self._open_message(self._until_probe()))

    def _until_probe(self) -> float:
        """Seconds until an open circuit lets a probe through (negative: it may now)."""
        return self.opened_at + self.cooldown_s - self.clock()

    def _open_message(self, wait: float) -> str:
        return (
            f"{self.name}: circuit open after {self.consecutive} failed requests in a row (last: "
            f"{self.last_error}); " + (f"next probe in {wait:.1f}s" if wait > 0 else "a probe is out")
        )

    def success(self) -> None:
        with self._lock:
            self.consecutive, self._probe_out = 0, False
            self._streak.clear()
            if self.state != CLOSED:
                down = self.clock() - self.down_since
                self._set(CLOSED)
                log.info("%s answers again: circuit closed after %.1fs open", self.name, down)

    def failure(self, error: str, key=None) -> None:
        """A failed request; `key` (its body's hash) when the failure may be its input's: a key
        already counted since the last success does not count again."""
        with self._lock:
            self.last_error = self.redact(error)
            if key is not None and self.state == CLOSED:
                if key in self._streak:
                    return
                self._streak.add(key)
            self.consecutive += 1
            if self.state == HALF_OPEN:
                self._probe_out = False
                self._open()
                log.warning(
                    "%s: the probe failed (%s); circuit open for another %gs",
                    self.name,
                    self.last_error,
                    self.cooldown_s,
                )
            elif self.state == CLOSED and self.failures and self.consecutive >= self.failures:
                self._open()
                self.times_opened += 1
                log.warning(
                    "%s: circuit open after %d failed requests in a row (last: %s); calls fail at once "
                    "without reaching it for %gs, then one probe",
                    self.name,
                    self.consecutive,
                    self.last_error,
                    self.cooldown_s,
                )

    def _open(self) -> None:
        self._streak.clear()
        self.opened_at = self.clock()
        if self.state == CLOSED:
            self.down_since = self.opened_at
        self._set(OPEN, opened=self.state == CLOSED)

    def _set(self, state: str, opened: bool = False) -> None:
        self.state = state
        self.on_change(state, opened)

    def status(self) -> dict:
        with self._lock:
            out = {
                "state": self.state,
                "consecutive_failures": self.consecutive,
                "times_opened": self.times_opened,
                "last_error": self.last_error or None,
            }
            if self.state != CLOSED:
                out["open_for_s"] = round(self.clock() - self.down_since, 3)
                out["next_probe_in_s"] = round(max(0.0, self._until_probe()), 3)
            return out
