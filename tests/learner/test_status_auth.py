"""The learner's HTTP status page asks for the bearer token like the reward HTTP API when one is
configured, before anything else; /healthz stays open for liveness probes. Every error is the
one shape; the status is strict JSON."""

import math
import socket

import httpx
import pytest

from services.learner.server import status_http
from tests.http_helpers import error_of

TOKEN = "s3cret"


class FakeService:
    def __init__(self):
        self.calls = 0

    def status(self):
        self.calls += 1
        return {"iteration": 7, "state": "training"}


@pytest.fixture()
def serve():
    servers = []

    def start(token):
        service = FakeService()
        httpd = status_http(service, "127.0.0.1", 0, token)
        servers.append(httpd)
        return service, f"http://127.0.0.1:{httpd.server_address[1]}"

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def _get(url, token=None):
    return httpx.get(url, headers={"Authorization": f"Bearer {token}"} if token is not None else {}, timeout=10)


@pytest.mark.parametrize("path", ["/status", "/", "/status?x=1"])
def test_status_requires_the_token(serve, path):
    service, base = serve(TOKEN)
    for token in (None, "nope", TOKEN.upper()):
        r = _get(base + path, token)
        assert "bearer token" in error_of(r, 401, param=None, code="invalid_api_key")["message"]
    assert service.calls == 0  # nothing of the run was computed for them
    r = _get(base + path, TOKEN)
    assert r.status_code == 200 and r.json() == {"iteration": 7, "state": "training"}


def test_healthz_stays_open_and_unknown_paths_are_404(serve):
    _, base = serve(TOKEN)
    assert _get(base + "/healthz").json() == {"ok": True}
    error_of(_get(base + "/nope", TOKEN), 404)
    error_of(_get(base + "/nope"), 401)


def test_every_error_is_the_one_shape_and_the_status_strict_json(serve):
    service, base = serve(TOKEN)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
        error_of(httpx.request(method, base + "/status", headers=auth, content=b"x" * 1000), 405)
        error_of(httpx.request(method, base + "/status", content=b"{}"), 401)
    assert httpx.head(base + "/status", headers=auth).status_code == 405
    service.status = lambda: {"reward": math.nan, "kl": [math.inf, 0.5], "iteration": 7}
    r = _get(base + "/status", TOKEN)
    assert r.status_code == 200 and r.json() == {"reward": None, "kl": [None, 0.5], "iteration": 7}

    def broken():
        raise RuntimeError("a bug")

    service.status = broken
    e = error_of(_get(base + "/status", TOKEN), 500)
    assert e["type"] == "server_error" and "a bug" not in e["message"]
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:  # what http.server refuses itself
        s.sendall(b"GET /status HTTP/1.1\r\nX-Long: " + b"a" * 70_000 + b"\r\n\r\n")
        answer = b""
        while chunk := s.recv(65536):  # the server closes the connection after an error
            answer += chunk
    assert answer.split()[1] == b"431" and b'{"error": {"message"' in answer


def test_without_a_configured_token_status_is_open(serve):
    _, base = serve(None)
    assert _get(base + "/status").json()["iteration"] == 7
