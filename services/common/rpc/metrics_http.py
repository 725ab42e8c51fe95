"""Prometheus `/metrics` over HTTP behind the bearer token the RPCs ask for: a server bound to
0.0.0.0 in a container would otherwise tell anyone who asks its traffic and its model's name.

    httpd, port = serve_metrics(registry, "0.0.0.0", 9101, metrics_token(cfg.rpc))
    ...
    httpd.stop()

A scraper sends `Authorization: Bearer <token>` (Prometheus: `authorization: {credentials: ...}`
in its scrape config); `rpc.open_metrics: true` serves it without (a default scrape).
"""

from __future__ import annotations

import hmac
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from .http_guard import error_bytes

if TYPE_CHECKING:
    from ..config_sections import RPCConfig


def metrics_token(rpc_cfg: RPCConfig) -> str | None:
    """The token /metrics requires: the RPCs' bearer token, or None (open) when `rpc.open_metrics`
    is set or no token is configured."""
    return None if rpc_cfg.open_metrics else rpc_cfg.resolved_auth_token()


class MetricsServer(ThreadingHTTPServer):
    daemon_threads = True

    def stop(self) -> None:
        """Stop serving and release the port."""
        self.shutdown()
        self.server_close()


def serve_metrics(
    registry: CollectorRegistry,
    host: str,
    port: int,
    token: str | None = None,
    health: Callable[[], str | None] | None = None,
) -> tuple[MetricsServer, int]:
    """Serve `registry` on http://host:port/metrics from a background thread; with a `token`, a
    request without `Authorization: Bearer <token>` gets 401. `/healthz` is open (for probes): 200
    "ok", or 503 with the reason `health()` returns when it returns one. Other paths are 404, other
    methods 405 (no body is read). Errors are the one shape of every HTTP surface,
    `{"error": {"message", "type", "param", "code"}}` (http_guard.py), http.server's own too.
    Returns the server (`stop()` it) and the port bound (a free one for port 0)."""
    expected = f"Bearer {token}".encode() if token is not None else None

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            path = self.path.split("?")[0]
            if path == "/healthz":
                problem = health() if health is not None else None
                return self._reply(503, f"{problem}\n".encode()) if problem else self._reply(200, b"ok\n")
            if path != "/metrics":
                return self._error(404, "not found; try /metrics or /healthz")
            if expected is not None and not hmac.compare_digest(
                self.headers.get("Authorization", "").encode("utf-8", "replace"), expected
            ):
                return self._error(
                    401,
                    "missing or wrong bearer token (header 'Authorization: Bearer ...')",
                    code="invalid_api_key",
                    extra=(("WWW-Authenticate", "Bearer"),),
                )
            return self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)

        def _refuse(self):
            self._error(405, f"{self.command} is not allowed; GET /metrics or /healthz", extra=(("Allow", "GET"),))

        do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_HEAD = _refuse

        def send_error(self, code, message=None, explain=None):
            """http.server's own refusals (400, 414, 431, 501) in the one shape."""
            self._error(code, message or explain or "the request could not be read")

        def _error(self, status: int, message: str, code: str | None = None, extra=()):
            self.close_connection = True  # a body a client sent is not read: the connection ends here
            self._reply(status, error_bytes(status, message, code=code), "application/json", extra)

        def _reply(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8", extra=()):
            reply(self, code, body, content_type, extra)

        def log_message(self, *args):
            pass

    class Server(MetricsServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    httpd = Server((host, port), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True, name=f"metrics-http-{httpd.server_address[1]}").start()
    return httpd, httpd.server_address[1]


def reply(handler, status: int, body: bytes, content_type: str, extra=()) -> None:
    """One answer of a stdlib `BaseHTTPRequestHandler` (the metrics port's, the learner's status
    port's): status, content type and length, `extra` headers, the body (none to a HEAD)."""
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    for k, v in extra:
        handler.send_header(k, v)
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(body)
