"""/metrics asks for the RPCs' bearer token (a container binds 0.0.0.0) unless `rpc.open_metrics`;
`serve_metrics` is the one server for it (RPCServer and the rollout worker)."""

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter

from services.common.config import config_from_dict
from services.common.rpc.metrics_http import metrics_token, serve_metrics
from services.common.rpc.server import RPCServer
from tests.http_helpers import error_of

TOKEN = "s3cret"


def _get(port, path="/metrics", token=None):
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return httpx.get(f"http://127.0.0.1:{port}{path}", headers=headers, timeout=10)


@pytest.fixture()
def registry():
    r = CollectorRegistry()
    Counter("rlhf_test_things_total", "things", registry=r).inc(3)
    return r


def test_serve_metrics_requires_the_token(registry):
    httpd, port = serve_metrics(registry, "127.0.0.1", 0, TOKEN)
    try:
        assert port == httpd.server_address[1] > 0
        assert _get(port).status_code == 401
        assert _get(port, token="nope").status_code == 401
        assert _get(port, "/", token=TOKEN).status_code == 404
        error_of(_get(port), 401, code="invalid_api_key")  # errors are the one shape of every HTTP surface
        error_of(_get(port, "/", token=TOKEN), 404)
        error_of(httpx.post(f"http://127.0.0.1:{port}/metrics", content=b"x" * 100), 405)
        ok = _get(port, token=TOKEN)
        assert ok.status_code == 200 and "rlhf_test_things_total 3.0" in ok.text
        assert ok.headers["content-type"].startswith("text/plain")
    finally:
        httpd.stop()
    with pytest.raises(httpx.TransportError):
        _get(port, token=TOKEN)


def test_serve_metrics_without_token_is_open(registry):
    httpd, port = serve_metrics(registry, "127.0.0.1", 0)
    try:
        assert "rlhf_test_things_total 3.0" in _get(port).text
    finally:
        httpd.stop()


@pytest.mark.parametrize(
    "rpc, env, want",
    [
        ({"auth_token": TOKEN}, None, TOKEN),
        ({"auth_token": TOKEN, "open_metrics": True}, None, None),
        ({}, None, None),
        ({"auth_token_env": "RLHF_TEST_METRICS_TOKEN"}, "from-env", "from-env"),
    ],
)
def test_metrics_token(monkeypatch, rpc, env, want):
    if env is not None:
        monkeypatch.setenv("RLHF_TEST_METRICS_TOKEN", env)
    assert metrics_token(config_from_dict({"rpc": rpc}).rpc) == want


@pytest.mark.parametrize("open_metrics", [False, True])
def test_rpc_server_metrics_port_asks_for_the_token(open_metrics):
    cfg = config_from_dict({"rpc": {"auth_token": TOKEN, "open_metrics": open_metrics}})
    server = RPCServer("critic", cfg.rpc, port=0, metrics_port=0, host="127.0.0.1").start()
    try:
        port = server.metrics_port
        assert _get(port).status_code == (200 if open_metrics else 401)
        ok = _get(port, token=TOKEN)
        assert ok.status_code == 200 and "rlhf_rpc_requests_total" in ok.text
    finally:
        server.stop(0)
    with pytest.raises(httpx.TransportError):
        _get(port, token=TOKEN)


def test_healthz_is_open_and_reports_the_health_check(registry):
    problem = [None]
    httpd, port = serve_metrics(registry, "127.0.0.1", 0, TOKEN, health=lambda: problem[0])
    try:
        ok = _get(port, "/healthz")
        assert ok.status_code == 200 and ok.text == "ok\n"
        problem[0] = "no heartbeat reached Redis for 31 s"
        bad = _get(port, "/healthz")
        assert bad.status_code == 503 and "no heartbeat" in bad.text
        assert _get(port).status_code == 401  # /metrics still asks for the token
    finally:
        httpd.stop()
