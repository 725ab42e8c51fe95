"""What a connection to any HTTP surface may hold before its request is admitted (uvicorn's side of
the Guard, `http_guard.py`, which bounds the request itself): its request headers due within
HEADER_TIMEOUT_S of connecting or of its last answer (a silent or slowloris connection is
closed), at most MAX_CONNECTIONS at once (uvicorn's `limit_concurrency`: 503 beyond), and a
request HTTP/1.1 itself cannot parse answered in the one error shape.

    uvicorn.Config(app, http=timed_protocol(HEADER_TIMEOUT_S), limit_concurrency=MAX_CONNECTIONS)
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .http_guard import error_bytes

HEADER_TIMEOUT_S = 10.0  # a connection's request headers must arrive within this (from connecting, or the last answer)
MAX_CONNECTIONS = 1024  # connections held at once; a request beyond is answered 503 (uvicorn's limit_concurrency)


class TimedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline for each request's headers: a connection that
    says nothing, or trickles its headers (slowloris), is closed `header_timeout_s` after it
    connected or after its last answer, instead of being held for ever. uvicorn's own keep-alive
    timeout closes an idle connection between requests; this covers the first request and a slow
    next one."""

    header_timeout_s = HEADER_TIMEOUT_S

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._arm()

    def _arm(self) -> None:
        """Start the headers' deadline while no request is in flight."""
        self._disarm()
        if self.cycle is None or self.cycle.response_complete:
            self._waiting_for = self.cycle
            self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        deadline, self._header_deadline = getattr(self, "_header_deadline", None), None
        if deadline is not None:
            deadline.cancel()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._header_deadline is not None and self.cycle is not self._waiting_for:
            self._disarm()  # a request's headers arrived: the body has its own deadline (Guard)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """A request HTTP itself cannot parse (a malformed Content-Length, a broken request
        line), answered in the one error shape, as every other error, not uvicorn's plain text."""
        body = error_bytes(400, f"the request is not valid HTTP/1.1 ({msg.rstrip('.')})", code="invalid_http")
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        for event in (h11.Response(status_code=400, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def _headers_late(self) -> None:
        self._header_deadline = None
        if not self.transport.is_closing():
            self.transport.close()


def timed_protocol(header_timeout_s: float = HEADER_TIMEOUT_S) -> type[TimedH11Protocol]:
    """The protocol class uvicorn takes (`http=`), its headers due within `header_timeout_s`."""
    return type("TimedH11Protocol", (TimedH11Protocol,), {"header_timeout_s": header_timeout_s})
