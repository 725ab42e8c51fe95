"""What a client that holds a connection without finishing its request costs every HTTP surface
(issue 54: slowloris headers, silent connections and bodies stopped short were all held for ever,
+199 MB for 20 bodies): a connection whose request headers do not arrive in time is closed, a body
that does not arrive in time is answered 408 in the one error shape and the connection closed, and
a request that does come in time is served as before. Real uvicorn over real sockets, with short
deadlines so that the test waits seconds, not minutes."""

import json
import socket
import time

from services.common.lifecycle import HTTPServerThread
from services.common.rpc.http_guard import Guard, bearer

HEADERS_DUE_S = 1.0
BODY_DUE_S = 1.0


def _app():
    from fastapi import FastAPI, Request

    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request):
        return {"got": len(await request.body())}

    return Guard(app, authorized=bearer(None), body_timeout_s=BODY_DUE_S)


def _closed_within(sock: socket.socket, bound_s: float) -> float:
    """Seconds until the server closed `sock` (recv gives b""), asserted under `bound_s`."""
    sock.settimeout(bound_s)
    t0 = time.monotonic()
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return time.monotonic() - t0
        data += chunk


def test_a_silent_or_trickling_connection_is_closed_and_a_stopped_body_is_408():
    http = HTTPServerThread(_app(), "127.0.0.1", 0, name="timeouts", header_timeout_s=HEADERS_DUE_S)
    port = http.start()
    try:
        silent = socket.create_connection(("127.0.0.1", port))
        assert _closed_within(silent, 15) >= HEADERS_DUE_S * 0.5  # closed by the server, not held

        trickle = socket.create_connection(("127.0.0.1", port))
        trickle.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\n")  # a slowloris' headers, never finished
        assert _closed_within(trickle, 15) > 0

        stopped = socket.create_connection(("127.0.0.1", port))
        stopped.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b"x" * 10)
        stopped.settimeout(15)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = stopped.recv(65536)
            if not chunk:
                break
            answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), answer[:200]
        error = json.loads(body)["error"]
        assert error["code"] == "request_timeout" and set(error) == {"message", "type", "param", "code"}

        ok = socket.create_connection(("127.0.0.1", port))  # a request that comes in time is served
        ok.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
        ok.settimeout(15)
        assert ok.recv(65536).startswith(b"HTTP/1.1 200")
        for s in (silent, trickle, stopped, ok):
            s.close()
    finally:
        http.stop()


def test_a_request_http_cannot_parse_is_answered_in_the_one_error_shape():
    """A malformed Content-Length got uvicorn's plain-text 400 (issue 54); now the one shape."""
    http = HTTPServerThread(_app(), "127.0.0.1", 0, name="bad-http", header_timeout_s=HEADERS_DUE_S)
    port = http.start()
    try:
        for request in (
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1x\r\n\r\nabc",
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabc",
        ):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(request)
            sock.settimeout(15)
            answer = b""
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                answer += chunk
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower(), answer
            error = json.loads(body)["error"]
            assert error["code"] == "invalid_http" and set(error) == {"message", "type", "param", "code"}
            sock.close()
    finally:
        http.stop()
