"""What every gRPC server of the system shares: bearer-token auth, request ids, Prometheus
metrics and error mapping in one interceptor; the standard health service (liveness on "",
readiness on the service's own name); optional TLS; message-size limits; graceful shutdown.

Readiness says whether to send work now (not while a weight swap waits for the batch); liveness
whether the process can still make progress at all: "" answers NOT_SERVING while the check given
to `set_liveness` names a reason (a vLLM engine broken by a failed reload, a learner's training
loop that stopped advancing), so that a supervisor (Kubernetes' liveness probe) restarts it.

    server = RPCServer("generation", rpc_cfg, port=50051, metrics_port=9101)
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server.grpc)
    server.start(); server.set_ready(True); server.wait()
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..metrics import LATENCY_BUCKETS, register_process_metrics
from .client import channel_options, reachable_host
from .errors import (
    BadRequest,
    DeadlineExceeded,
    FailedPrecondition,
    ResourceExhausted,
    Unavailable,
    Unimplemented,
    status_for,
)
from .metrics_http import metrics_token, serve_metrics

if TYPE_CHECKING:
    from ..config_sections import RPCConfig

log = logging.getLogger(__name__)

HEALTH_PREFIX = "/grpc.health.v1.Health/"

# the status each exception a servicer raises is answered with (the first match wins); anything
# else is a bug: INTERNAL. RecursionError / OverflowError come from the input (deeply nested
# JSON, a number too large for C), not from the server.
STATUS_OF = (
    (BadRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (Unimplemented, grpc.StatusCode.UNIMPLEMENTED),
    ((RecursionError, OverflowError), grpc.StatusCode.INVALID_ARGUMENT),
)
_MAPPED = tuple(c for classes, _ in STATUS_OF for c in (classes if isinstance(classes, tuple) else (classes,)))

# how long a stopping server keeps its connections open after its last call's answer left the
# handler: gRPC closes a connection as soon as its calls are done, and a close with bytes of the
# client's still unread resets it, taking the unsent tail of a large answer with it (measured
# here: 3 MB answers cut in 4 of 30 stops without it, none of 30 with 0.5 s)
DRAIN_LINGER_S = 1.0


class ServiceMetrics:
    """The metrics every gRPC server has, in a registry of its own (several servers in one
    process): its calls (`rlhf_rpc_requests_total`, `rlhf_rpc_latency_seconds`, and those being
    handled now, `rlhf_rpc_in_flight`) and its process
    (`process_*`, `python_info`). What only some servers do (batches, tokens) each of them adds
    to `registry` itself, so no server exports another's empty families."""

    def __init__(self, service: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.requests = Counter(
            "rlhf_rpc_requests_total", "RPCs handled", ["service", "method", "code"], registry=self.registry
        )
        self.latency = Histogram(
            "rlhf_rpc_latency_seconds",
            "RPC latency",
            ["service", "method"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "rlhf_rpc_in_flight", "RPCs being handled now", ["service", "method"], registry=self.registry
        )
        register_process_metrics(self.registry, service)
        self.service = service


def batch_size_histogram(metrics: ServiceMetrics, what: str):
    """`rlhf_batch_size{service, what}` in a batching server's registry (generation: prompts,
    reward: samples, critic: sequences); the child to observe."""
    family = Histogram(
        "rlhf_batch_size",
        "items per batch",
        ["service", "what"],
        buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
        registry=metrics.registry,
    )
    return family.labels(metrics.service, what)


class _Undecodable:
    """What a wrapped request deserializer returns for bytes that are not the method's request
    message: gRPC would answer its exception with INTERNAL and log a traceback per request."""

    __slots__ = ("message",)

    def __init__(self, message: str):
        self.message = message


def _lenient(deserialize):
    """`deserialize`, returning an `_Undecodable` instead of raising."""
    if deserialize is None:
        return None
    owner = getattr(deserialize, "__self__", None)
    name = getattr(getattr(owner, "DESCRIPTOR", None), "name", None) or getattr(owner, "__name__", "request message")

    def inner(data: bytes):
        try:
            return deserialize(data)
        except Exception as e:  # DecodeError, bad UTF-8, nesting too deep, ...
            return _Undecodable(f"request: not a valid {name} ({str(e)[:200]})")

    return inner


def _decoded(request):
    if isinstance(request, _Undecodable):
        raise BadRequest(request.message)
    return request


def _decoded_stream(requests):
    """A client stream's messages; an undecodable one raises `BadRequest` where the servicer reads it."""
    for r in requests:
        yield _decoded(r)


# a status message's budget in UTF-8 bytes: it travels in the trailer twice (grpc-message, where
# gRPC writes each non-ASCII byte as three, and inside the error details), and a trailer past the
# receiver's metadata limit loses the whole status (its code, reason and message)
MESSAGE_BYTES = 1200


def _brief(text: str, limit: int = MESSAGE_BYTES) -> str:
    """`text` within `limit` UTF-8 bytes: its start and its end (a traceback's last line says
    what was raised), the middle elided."""
    raw = text.encode()
    if len(raw) <= limit:
        return text
    head, tail = raw[: limit // 4], raw[-(limit - limit // 4 - 40) :]
    cut = head.decode(errors="ignore") + f" ... ({len(raw)} bytes, cut) ... " + tail.decode(errors="ignore")
    return cut


def _raised_at(e: BaseException) -> tuple[str, int]:
    """File and line of the innermost frame of `e`'s traceback (where it was raised)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return (tb.tb_frame.f_code.co_filename, tb.tb_lineno) if tb is not None else ("?", 0)


class _Calls:
    """The calls a server is handling (health probes aside), when the last one ended, and the gate
    a stopping server closes: `drain` refuses new calls, waits for those in flight, then lingers
    until their answers have had DRAIN_LINGER_S to reach their clients."""

    def __init__(self):
        self._cond = threading.Condition()
        self._n = 0
        self._last_end = float("-inf")
        self._closed = False

    def enter(self) -> bool:
        with self._cond:
            if self._closed:
                return False
            self._n += 1
            return True

    def leave(self) -> None:
        with self._cond:
            self._n -= 1
            self._last_end = time.monotonic()
            self._cond.notify_all()

    def drain(self, deadline: float) -> None:
        with self._cond:
            self._closed = True
            self._cond.wait_for(lambda: self._n == 0, timeout=max(0.0, deadline - time.monotonic()))
            rest = min(self._last_end + DRAIN_LINGER_S, deadline) - time.monotonic()
        if rest > 0:
            time.sleep(rest)


class _ServerInterceptor(grpc.ServerInterceptor):
    """Checks the bearer token, returns a request id in the trailing metadata, answers request
    bytes that do not decode with INVALID_ARGUMENT, the exceptions of `STATUS_OF` with their
    status and any other exception with INTERNAL (logged with its traceback the first time per
    method, exception type and raising line, in one line after that), and counts each call's
    status and latency; a server-streaming call's when its stream ends."""

    def __init__(self, service: str, token: str | None, metrics: ServiceMetrics, calls: _Calls):
        self.service, self.token, self.metrics, self.calls = service, token, metrics, calls
        self._seen: set[tuple] = set()  # (method, exception type, file, line) already logged
        self._seen_lock = threading.Lock()

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or details.method.startswith(HEALTH_PREFIX):
            return handler  # health stays open for probes (kubelet sends no token)
        method = details.method.rsplit("/", 1)[-1]
        authorized = (
            self.token is None or dict(details.invocation_metadata).get("authorization") == f"Bearer {self.token}"
        )

        def wrap_unary(fn, decode):
            def inner(request_or_iterator, context):
                with self._accounted(method, authorized, context):
                    return fn(decode(request_or_iterator), context)

            return inner

        def wrap_stream(fn):
            def inner(request, context):
                with self._accounted(method, authorized, context):
                    yield from fn(_decoded(request), context)

            return inner

        deserialize = _lenient(handler.request_deserializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                wrap_unary(handler.unary_unary, _decoded), deserialize, handler.response_serializer
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                wrap_unary(handler.stream_unary, _decoded_stream), deserialize, handler.response_serializer
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                wrap_stream(handler.unary_stream), deserialize, handler.response_serializer
            )
        return handler

    @contextlib.contextmanager
    def _accounted(self, method: str, authorized: bool, context):
        t0 = time.perf_counter()
        code = grpc.StatusCode.OK
        request_id = dict(context.invocation_metadata()).get("x-request-id") or uuid.uuid4().hex[:12]
        if not self.calls.enter():
            self.metrics.requests.labels(self.service, method, grpc.StatusCode.UNAVAILABLE.name).inc()
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the {self.service} server is stopping")
        in_flight = self.metrics.in_flight.labels(self.service, method)
        in_flight.inc()
        try:
            if not authorized:
                code = grpc.StatusCode.UNAUTHENTICATED
                context.abort(code, "missing or wrong bearer token (metadata 'authorization: Bearer ...')")
            context.set_trailing_metadata((("x-request-id", request_id),))
            yield
        except GeneratorExit:  # the client went away in the middle of a stream
            code = grpc.StatusCode.CANCELLED
            raise
        except _MAPPED as e:
            code = next(c for classes, c in STATUS_OF if isinstance(e, classes))
            builtin = isinstance(e, (RecursionError, OverflowError))
            if builtin and self._first(method, e):
                log.warning(
                    "%s/%s: %s: %s (answered %s; request %s)",
                    self.service,
                    method,
                    type(e).__name__,
                    e,
                    code.name,
                    request_id,
                )
            message = _brief(f"request: {type(e).__name__}: {e}" if builtin else str(e))
            # with its reason and fields; aborting with a status replaces the trailing metadata
            context.abort_with_status(status_for(code, message, e, trailing=(("x-request-id", request_id),)))
        except Exception as e:
            if code == grpc.StatusCode.OK:  # context.abort raises a plain Exception
                got = getattr(context, "code", lambda: None)()
                if got is not None and got != grpc.StatusCode.OK:
                    code = got
                else:
                    code = grpc.StatusCode.INTERNAL
                    if self._first(method, e):
                        log.exception("%s/%s failed (request %s)", self.service, method, request_id)
                    else:
                        where = "%s:%d" % _raised_at(e)
                        log.error(
                            "%s/%s failed (request %s): %s: %s at %s (traceback logged once)",
                            self.service,
                            method,
                            request_id,
                            type(e).__name__,
                            _brief(str(e), 400),
                            where,
                        )
                    context.abort(code, _brief(f"internal error: {type(e).__name__}: {e}"))
            raise
        finally:
            in_flight.dec()
            self.calls.leave()
            self.metrics.requests.labels(self.service, method, code.name).inc()
            self.metrics.latency.labels(self.service, method).observe(time.perf_counter() - t0)

    def _first(self, method: str, e: BaseException) -> bool:
        """True the first time `method` raises this exception type at this line."""
        key = (method, type(e), *_raised_at(e))
        with self._seen_lock:
            if key in self._seen:
                return False
            self._seen.add(key)
            return True


class _Health(health.HealthServicer):
    """The standard health service, with liveness ("") asked of a check at each probe: NOT_SERVING
    while `liveness()` returns a reason (logged when it appears and when it clears)."""

    def __init__(self, service: str):
        super().__init__()
        self.service = service
        self.liveness = None  # () -> str | None: why this process can no longer make progress
        self._reason: str | None = None
        self._stopping = False

    def live(self) -> str | None:
        """None while alive; else the reason."""
        check = self.liveness
        try:
            reason = check() if check is not None else None
        except Exception as e:  # a check that fails says nothing about the process: alive, and logged
            log.warning("%s: the liveness check failed (%s: %s); answering alive", self.service, type(e).__name__, e)
            reason = None
        if reason != self._reason:
            if reason:
                log.critical("%s: liveness fails (a restart is what helps): %s", self.service, reason)
            else:
                log.warning("%s: alive again (the liveness check passes)", self.service)
            self._reason = reason
            if not self._stopping:  # Watch subscribers hear it too
                self.set(
                    "", health_pb2.HealthCheckResponse.NOT_SERVING if reason else health_pb2.HealthCheckResponse.SERVING
                )
        return reason

    def Check(self, request, context):  # gRPC's name
        if request.service == "" and not self._stopping and self.liveness is not None and self.live():
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)
        return super().Check(request, context)

    def enter_graceful_shutdown(self):
        self._stopping = True
        super().enter_graceful_shutdown()


class RPCServer:
    def __init__(
        self,
        service: str,
        rpc_cfg: RPCConfig,
        port: int,
        metrics_port: int | None = None,
        host: str | None = None,
        max_workers: int = 16,
        registry: CollectorRegistry | None = None,
    ):
        self.service, self.cfg = service, rpc_cfg
        self.metrics = ServiceMetrics(service, registry)
        token = rpc_cfg.resolved_auth_token()
        self._calls = _Calls()
        self.grpc = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers),
            interceptors=[_ServerInterceptor(service, token, self.metrics, self._calls)],
            options=channel_options(rpc_cfg.max_message_mb),
        )
        self.health = _Health(service)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        address = f"{host or rpc_cfg.host}:{port}"
        self.host = host or rpc_cfg.host
        if rpc_cfg.tls_cert_file:
            assert rpc_cfg.tls_key_file is not None  # RPCConfig: set together with tls_cert_file
            key = Path(rpc_cfg.tls_key_file).read_bytes()
            cert = Path(rpc_cfg.tls_cert_file).read_bytes()
            creds = grpc.ssl_server_credentials([(key, cert)])
            self.port = self.grpc.add_secure_port(address, creds)
        else:
            self.port = self.grpc.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot bind {address}")
        self.metrics_port = None
        if metrics_port is not None:  # /metrics asks for the bearer token unless rpc.open_metrics
            self._metrics_httpd, self.metrics_port = serve_metrics(
                self.metrics.registry, self.host, metrics_port, metrics_token(rpc_cfg)
            )
        self.ready_name = f"rlhf.v1.{service.capitalize()}"
        self._stopped = threading.Event()
        self._ready = False
        self.health.set(self.ready_name, health_pb2.HealthCheckResponse.NOT_SERVING)

    def start(self) -> "RPCServer":
        self.grpc.start()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)  # alive
        log.info(
            "%s server listening on %s:%d%s",
            self.service,
            self.host,
            self.port,
            f" (metrics on :{self.metrics_port})" if self.metrics_port else "",
        )
        return self

    def set_ready(self, ready: bool) -> None:
        """Readiness on the health service's `rlhf.v1.<Name>`; a stopping server is never ready."""
        ready = ready and not self._stopped.is_set()
        self._ready = ready
        self.health.set(
            self.ready_name,
            health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING,
        )

    def stop(self, grace: float | None = None) -> None:
        """Refuse new calls (UNAVAILABLE), let those in flight finish and their answers reach
        their clients (up to `grace` seconds in all; rpc.grace_s), then stop."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.set_ready(False)
        self.health.enter_graceful_shutdown()
        deadline = time.monotonic() + (self.cfg.grace_s if grace is None else grace)
        self._calls.drain(deadline)
        self.grpc.stop(max(0.0, deadline - time.monotonic())).wait()
        if getattr(self, "_metrics_httpd", None) is not None:
            self._metrics_httpd.stop()
        log.info("%s server stopped", self.service)

    def is_ready(self) -> bool:
        return self._ready

    def set_liveness(self, check) -> None:
        """Liveness (health service "") from now on asks `check()`: None while this process can
        still make progress, else why not (then "" answers NOT_SERVING, and the reason is logged)."""
        self.health.liveness = check

    def liveness(self) -> str | None:
        """None while alive, else why not (what the health service's "" answers)."""
        return self.health.live()

    def wait(self) -> None:
        self.grpc.wait_for_termination()


def advertised_address(rpc_cfg: RPCConfig, host: str, port: int) -> str:
    """host:port this server tells others (Redis registry): `rpc.advertise_host` (the pod IP in
    Kubernetes) or the bound host."""
    return f"{rpc_cfg.advertise_host or reachable_host(host)}:{port}"
