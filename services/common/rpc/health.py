"""Ask a server's standard gRPC health service: what `rlhf up` waits on, and what a container's
healthcheck runs (`python -m services.common.rpc.health HOST:PORT [SERVICE]`, exit 0 = serving).

SERVICE "" asks liveness; `rlhf.v1.<Name>` (e.g. rlhf.v1.Generation) asks readiness.
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def readiness_name(service: str) -> str:
    """The health-service name a server reports readiness under: rlhf.v1.<Name>."""
    return f"rlhf.v1.{service.capitalize()}"


def status(address: str, service: str = "", timeout_s: float = 2.0, tls_ca: bytes | None = None) -> str:
    """What `address` answers for `service`: "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN", ...;
    raises `grpc.RpcError` when it gives no answer within `timeout_s`."""
    channel = (
        grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=tls_ca))
        if tls_ca
        else grpc.insecure_channel(address)
    )
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    finally:
        channel.close()


def check(address: str, service: str = "", timeout_s: float = 2.0, tls_ca: bytes | None = None) -> bool:
    """True if `address` answers SERVING for `service`; False if it answers anything else or
    cannot be reached within `timeout_s`."""
    try:
        return status(address, service, timeout_s, tls_ca) == "SERVING"
    except grpc.RpcError:
        return False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not 1 <= len(argv) <= 2:
        print("usage: python -m services.common.rpc.health HOST:PORT [SERVICE]", file=sys.stderr)
        return 2
    return 0 if check(argv[0], argv[1] if len(argv) == 2 else "") else 1


if __name__ == "__main__":
    sys.exit(main())
