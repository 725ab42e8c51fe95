"""The learner's HTTP status page asks for the bearer token like the reward HTTP API when one is
configured; /healthz stays open for liveness probes."""

import httpx
import pytest

from services.learner.server import status_http

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
        assert r.status_code == 401 and "bearer token" in r.json()["error"]
    assert service.calls == 0  # nothing of the run was computed for them
    r = _get(base + path, TOKEN)
    assert r.status_code == 200 and r.json() == {"iteration": 7, "state": "training"}


def test_healthz_stays_open_and_unknown_paths_are_404(serve):
    _, base = serve(TOKEN)
    assert _get(base + "/healthz").json() == {"ok": True}
    assert _get(base + "/nope", TOKEN).status_code == 404


def test_without_a_configured_token_status_is_open(serve):
    _, base = serve(None)
    assert _get(base + "/status").json()["iteration"] == 7
