"""The learner's network faces: gRPC (PullWeights for a generation server that starts late,
Status) and a JSON status page over HTTP; and `serve(cfg)`, its lifecycle."""

from __future__ import annotations

import functools
import hmac
import json
import logging
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from ..common.lifecycle import Service
from ..common.rpc.gen import learner_pb2 as lpb
from ..common.rpc.gen import learner_pb2_grpc
from ..common.rpc.http_guard import error_bytes
from ..common.rpc.metrics_http import reply
from ..common.rpc.server import RPCServer, advertised_address
from ..weights.protocol import CHUNK_BYTES, chunk_bytes
from ..weights.stream import StreamSpec, weight_chunks
from .run import LearnerLoop

if TYPE_CHECKING:
    from ..common.config import Config

log = logging.getLogger(__name__)


class LearnerServicer(learner_pb2_grpc.LearnerServicer):
    def __init__(self, loop, chunk_bytes: int = CHUNK_BYTES):
        self.loop, self.chunk_bytes = loop, chunk_bytes  # PullWeights' pieces

    def PullWeights(self, request, context):
        policy_version, state = self.loop.publisher.snapshot
        if not state or request.have_policy_version >= policy_version:
            return
        sink = self.loop.sink  # the fencing identity of this process's pushes
        spec = StreamSpec(policy_version, self.chunk_bytes, run_id=sink.run_id, epoch=sink.fence_epoch)
        yield from weight_chunks(state, spec)

    def Status(self, request, context):
        s = self.loop.status()
        return lpb.LearnerStatus(**{k: v for k, v in s.items() if k in lpb.LearnerStatus.DESCRIPTOR.fields_by_name})


def finite(value):
    """`value` (JSON-like) with every float that is not finite as None: strict JSON (a NaN that
    `json.dumps` writes as `NaN` is not JSON, and strict clients refuse the whole answer)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def status_http(loop, host: str, port: int, token: str | None = None) -> ThreadingHTTPServer:
    """JSON `/status` (and `/`) of `loop`; with a `token`, only for requests that carry
    `Authorization: Bearer <token>` (401 otherwise, on every path but /healthz, before anything
    else). `/healthz` stays open for liveness probes: 200 while the training loop advances, 503
    with the reason once it has not for the liveness bound (`loop.liveness()`, see liveness.py).
    Every error is the one shape, `{"error": {"message", "type", "param", "code"}}`: 401, 404,
    405 (a method other than GET: no body is read), 500 (the status could not be read), and
    what http.server refuses itself (a malformed request line, headers too long). The status is
    strict JSON (a value that is not finite is null)."""
    expected = f"Bearer {token}".encode() if token is not None else None
    httpd = ThreadingHTTPServer((host, port), functools.partial(StatusHandler, loop, expected))
    threading.Thread(target=httpd.serve_forever, daemon=True, name="status-http").start()
    return httpd


class StatusHandler(BaseHTTPRequestHandler):
    """One request to `status_http`'s server: `loop`'s status or liveness, or the error, for a
    request that carries `expected` (the whole Authorization header; None: any request)."""

    def __init__(self, loop, expected: bytes | None, *args):
        self.loop, self.expected = loop, expected
        super().__init__(*args)

    def do_GET(self):
        path = self.path.split("?")[0]
        if path == "/healthz":
            check = getattr(self.loop, "liveness", None)
            reason = check() if check is not None else None
            body, code = (
                (json.dumps({"ok": False, "reason": reason}).encode(), 503) if reason else (b'{"ok": true}', 200)
            )
            return self._reply(code, body)
        if not self._authorized():
            return
        if path not in ("/status", "/"):
            return self._error(404, f"no route GET {path[:200]}; try /status")
        try:
            body = json.dumps(finite(self.loop.status()), default=str, allow_nan=False).encode()
        except Exception:
            log.exception("the learner's status could not be read")
            return self._error(500, "internal error (the learner logged it)")
        self._reply(200, body)

    def _refuse(self):
        if self._authorized():
            self._error(405, f"{self.command} is not allowed; GET /status", extra=(("Allow", "GET"),))

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_HEAD = _refuse

    def _authorized(self) -> bool:
        given = self.headers.get("Authorization", "").encode("utf-8", "replace")
        if self.expected is None or hmac.compare_digest(given, self.expected):
            return True
        self._error(
            401,
            "missing or wrong bearer token (Authorization: Bearer <token>)",
            code="invalid_api_key",
            extra=(("WWW-Authenticate", "Bearer"),),
        )
        return False

    def send_error(self, code, message=None, explain=None):
        """http.server's own refusals (400, 414, 431, 501) in the one shape."""
        self.close_connection = True
        self._error(code, message or explain or "the request could not be read")

    def _error(self, status: int, message: str, code: str | None = None, extra=()):
        self._reply(status, error_bytes(status, message, code=code), extra)

    def _reply(self, status: int, body: bytes, extra=()):
        if status >= 400:
            self.close_connection = True  # a body a client sent is not read: the connection ends here
        reply(self, status, body, "application/json", extra)

    def log_message(self, *args):
        pass


class LearnerService(Service):
    """`serve(cfg)`'s handle: start() builds the learner (loads the policy, the reference, the
    optimiser), then binds its ports and serves gRPC (and HTTP status), like every service; it is
    ready once it has resumed and published the current policy; run() is the training loop."""

    name = "learner"

    def __init__(self, cfg: Config, run_dir=None):
        self.cfg, self.run_dir = cfg, run_dir
        self.loop: LearnerLoop | None = None
        self.server: RPCServer | None = None
        self.http: ThreadingHTTPServer | None = None
        self._stopped = False

    def start(self) -> "LearnerService":
        cfg, ep = self.cfg, self.cfg.rpc.learner
        registry = CollectorRegistry()  # the loop's metrics and the server's on one /metrics
        self.loop = LearnerLoop(cfg, self.run_dir, registry=registry)
        self.server = RPCServer("learner", cfg.rpc, ep.port, ep.metrics_port, host=ep.host, registry=registry)
        self.loop.sink.address = advertised_address(cfg.rpc, ep.host, self.server.port)
        self.server.set_liveness(self.loop.liveness)  # gRPC health "" says what /healthz says
        learner_pb2_grpc.add_LearnerServicer_to_server(
            LearnerServicer(self.loop, chunk_bytes(cfg.rpc.max_message_mb)), self.server.grpc
        )
        self.server.start()
        if ep.http_port is not None:
            self.http = status_http(self.loop, ep.host, ep.http_port, cfg.rpc.resolved_auth_token())
        threading.Thread(target=self._report_ready, name="learner-ready", daemon=True).start()
        return self

    def _started(self) -> tuple[LearnerLoop, RPCServer]:
        if self.loop is None or self.server is None:
            raise RuntimeError("LearnerService.start() first")
        return self.loop, self.server

    def _report_ready(self) -> None:
        loop, server = self._started()
        loop.ready.wait()
        server.set_ready(True)

    @property
    def ready(self) -> bool:
        return self.server is not None and self.server.is_ready()

    def endpoints(self) -> dict:
        _, server = self._started()
        return {
            "port": server.port,
            "metrics_port": server.metrics_port,
            "http_port": self.http.server_address[1] if self.http else None,
        }

    def run(self) -> int:
        from ..common.rpc.retry import DependencyUnavailable
        from .parity import PushParityFailed

        loop, _ = self._started()
        try:
            loop.run()
        except DependencyUnavailable:
            return 1  # the service logged what is missing and what a restart does
        except PushParityFailed:
            return 1  # the loop logged which server does not serve which version
        return 0

    def drain(self) -> None:
        if self.loop is not None:
            self.loop.stop()  # the loop checkpoints and returns

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self.loop is not None:
            self.loop.ready.set()  # releases the readiness thread
        if self.http is not None:
            self.http.shutdown()
        if self.server is not None:
            self.server.stop(grace=2)
        if self.loop is not None:
            self.loop.close()


def serve(cfg: Config, run_dir=None) -> LearnerService:
    """The learner service on `rpc.learner`'s ports (metrics and HTTP: null = off)."""
    return LearnerService(cfg, run_dir)
