"""The futures of the Tinker API: a request that computes answers at once with a request id, and
its result is fetched with retrieve_future (`Futures.wait`: held until it is done or `hold_s`
passed, then 408, which the SDK asks again on at once).

A result is an `Outcome`: a JSON body, protobuf bytes (forward_backward, sample) or a failure,
`{"error": {the one error shape}, "category": "user" | "server"}` (the SDK raises its
RequestFailedError on a body with `error` and `category`). At most `limit` are kept, holding at
most `max_bytes` of results: beyond either the oldest finished go; with every one still pending,
a new request is refused (429)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from ..common.rpc.http_guard import error_body
from .protocol import ApiError, Ids

log = logging.getLogger(__name__)

JSON, PROTOBUF = "application/json", "application/x-protobuf"


@dataclass(frozen=True)
class Outcome:
    body: bytes
    media_type: str = JSON


def json_outcome(obj: dict) -> Outcome:
    return Outcome(json.dumps(obj).encode())


def failed(message: str, category: str = "user", code: str | None = None) -> Outcome:
    return json_outcome({**error_body(message, code=code), "category": category})


def outcome_of(work: Callable[[], Outcome]) -> Outcome:
    """`work()`, whatever it raises as a failed Outcome: an ApiError is the client's (its
    message), anything else the server's (logged; the client is told only that)."""
    try:
        return work()
    except ApiError as e:
        return failed(e.message, "user", e.code)
    except Exception:
        log.exception("a Tinker API request failed")
        return failed("internal error (the server logged it)", "server")


class Futures:
    def __init__(self, ids: Ids, limit: int, hold_s: float, max_bytes: int):
        self.ids, self.limit, self.hold_s, self.max_bytes = ids, limit, hold_s, max_bytes
        self._futures: OrderedDict[str, Future] = OrderedDict()
        self._bytes = 0  # of the finished ones' results
        self._lock = threading.Lock()

    def create(self) -> tuple[str, Future]:
        """A new request id and its pending Future (set by whoever computes it)."""
        with self._lock:
            while len(self._futures) >= self.limit or self._bytes > self.max_bytes:
                done = next((k for k, f in self._futures.items() if f.done()), None)
                if done is None:
                    raise ApiError(
                        429,
                        f"{self.limit} requests are in flight, this server's limit (tinker.max_futures); "
                        "retry when some have finished",
                        code="too_many_requests",
                    )
                self._bytes -= len(self._futures.pop(done).result().body)
            request_id = self.ids.new("r")
            future: Future = Future()
            future.add_done_callback(self._count)
            self._futures[request_id] = future
            return request_id, future

    def pending(self) -> int:
        """Requests whose result is not computed yet."""
        with self._lock:
            return sum(not f.done() for f in self._futures.values())

    def _count(self, future: Future) -> None:
        with self._lock:
            self._bytes += len(future.result().body)

    def get(self, request_id: str) -> Future:
        with self._lock:
            fut = self._futures.get(request_id)
        if fut is not None:
            return fut
        if self.ids.earlier(request_id):
            raise ApiError(
                404,
                f"request {request_id} was made to a server process that has since restarted: its result is lost "
                "(a training model's state went with it: load your last checkpoint)",
                param="request_id",
                code="server_restarted",
            )
        raise ApiError(404, f"no request {request_id[:80]} (or its result is no longer kept)", param="request_id")

    async def wait(self, request_id: str, on_wait: Callable[[], None] = lambda: None) -> Outcome | None:
        """The request's Outcome once done, or None after `hold_s` without it (`on_wait` first: a
        check that may fail it, the sequence's wait for a seq_id that never came)."""
        fut = self.get(request_id)
        on_wait()
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), self.hold_s)
        except asyncio.TimeoutError:
            return None
