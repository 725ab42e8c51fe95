"""The client side of every gRPC call between services: the channel (TLS when configured, quick
reconnects), the bearer token, a default deadline, and the interceptors a caller stacks on it
(retry.py); the address to dial for a configured endpoint."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import grpc

if TYPE_CHECKING:
    from ..config_sections import RPCConfig


# metadata (headers, and the trailer with a status's message and error details) a peer may send:
# past gRPC's default (8 KiB soft, 16 KiB hard) the receiver drops the call's status
METADATA_BYTES = 64 << 10


class Abandoned(Exception):
    """The caller of a call went away (its HTTP client hung up): the call was cancelled."""


class Cancel:
    """Set when whoever waits for a piece of work goes away: every call bound to it (`bind`) is
    cancelled then, or at once when bound after; `check` raises `Abandoned` once it is set."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._set = False
        self._calls: list[Callable[[], object]] = []

    def __call__(self) -> None:
        with self._lock:
            self._set, calls, self._calls = True, self._calls, []
        for cancel in calls:
            cancel()

    @property
    def is_set(self) -> bool:
        return self._set

    def bind(self, cancel: Callable[[], object]) -> None:
        with self._lock:
            if not self._set:
                self._calls.append(cancel)
                return
        cancel()

    def check(self) -> None:
        if self._set:
            raise Abandoned("the caller went away")


def channel_options(max_message_mb: int) -> list[tuple[str, int]]:
    """Message and metadata limits, the same for clients and servers."""
    limit = max_message_mb * 1024 * 1024
    return [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        ("grpc.max_metadata_size", METADATA_BYTES),
        ("grpc.absolute_max_metadata_size", METADATA_BYTES),
    ]


def client_channel(address: str, rpc_cfg: RPCConfig) -> grpc.Channel:
    # a server that restarts is dialled again within a second or so of coming back, not after
    # gRPC's default reconnect backoff (which grows to 120 s); the callers' own retries pace the calls
    reconnect_ms = int(min(rpc_cfg.retry_max_backoff_s, 2.0) * 1000)
    opts = channel_options(rpc_cfg.max_message_mb) + [
        ("grpc.initial_reconnect_backoff_ms", min(200, reconnect_ms)),
        ("grpc.min_reconnect_backoff_ms", min(200, reconnect_ms)),
        ("grpc.max_reconnect_backoff_ms", reconnect_ms),
    ]
    ca_file = rpc_cfg.tls_ca_file or rpc_cfg.tls_cert_file
    if ca_file:
        ca = Path(ca_file).read_bytes()
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca), opts)
    return grpc.insecure_channel(address, opts)


def reachable_host(host: str) -> str:
    """An address to dial for a server bound to `host` (a wildcard bind is reached on loopback)."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def endpoint_address(ep) -> str:
    """host:port to dial a configured endpoint (`rpc.reward`, `rpc.critic`, ...)."""
    return f"{reachable_host(ep.host)}:{ep.port}"


def call_metadata(rpc_cfg: RPCConfig) -> tuple:
    token = rpc_cfg.resolved_auth_token()
    return (("authorization", f"Bearer {token}"),) if token else ()


class RPCClient:
    """Channel (TLS when configured), bearer-token metadata and a default deadline for a stub;
    `interceptors` around every call (retry.py: riding through a restart, tagging, a heartbeat),
    the first outermost."""

    stub_class: type = object

    def __init__(
        self,
        address: str,
        rpc_cfg: RPCConfig,
        timeout_s: float | None = None,
        interceptors: Sequence[grpc.UnaryUnaryClientInterceptor] = (),
    ):
        self.address = address
        self._channel = client_channel(address, rpc_cfg)
        self.channel = grpc.intercept_channel(self._channel, *interceptors) if interceptors else self._channel
        self.stub = self.stub_class(self.channel)
        self.metadata = call_metadata(rpc_cfg)
        self.timeout = timeout_s or rpc_cfg.timeout_s

    def close(self) -> None:
        self._channel.close()
