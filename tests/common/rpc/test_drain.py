"""A stopping server's drain: new calls are refused with UNAVAILABLE while those in flight finish,
and their answers reach their clients whole.

Found by CI (test_serve_process_graceful_sigterm): gRPC closes a connection as soon as its calls
are done; closing with bytes of the client's unread resets the connection, and the unsent tail of
a large answer is lost. It cut 3 MB answers in 4 of 30 stops measured here."""

import threading

import grpc
import pytest

from services.common.config import config_from_dict
from services.common.rpc.server import RPCServer
from tests.waits import wait_until

TOKEN = "s3cret"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
ANSWER_BYTES = 3_000_000


def _server(handler):
    cfg = config_from_dict({"rpc": {"auth_token": TOKEN, "grace_s": 60}})
    server = RPCServer("generation", cfg.rpc, port=0, host="127.0.0.1")
    server.grpc.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("test.Big", {"Get": grpc.unary_unary_rpc_method_handler(handler)}),)
    )
    return server.start()


def test_a_stopping_server_refuses_new_calls_and_finishes_those_in_flight():
    release, entered = threading.Event(), threading.Event()

    def get(request, context):
        entered.set()
        release.wait(60)
        return b"x" * ANSWER_BYTES

    server = _server(get)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}", options=[("grpc.max_receive_message_length", 8 << 20)])
    call = channel.unary_unary("/test.Big/Get")
    try:
        first = call.future(b"", metadata=AUTH)
        assert entered.wait(60)
        stopper = threading.Thread(target=server.stop)
        stopper.start()
        wait_until(lambda: not server.is_ready(), "the server to begin stopping", 60)
        with pytest.raises(grpc.RpcError) as refused:
            call(b"", metadata=AUTH, timeout=60)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "stopping" in refused.value.details()
        release.set()
        assert len(first.result(timeout=60)) == ANSWER_BYTES
        stopper.join(60)
        assert not stopper.is_alive()
    finally:
        release.set()
        channel.close()
        server.stop(0)


def test_large_answers_in_flight_reach_their_clients_whole():
    """Ten stops, each with a 3 MB answer leaving the handler just before the stop begins; without
    the drain's linger, about one stop in eight lost its answer's tail (UNAVAILABLE, connection reset)."""
    for attempt in range(10):
        entered = threading.Event()
        go = threading.Event()

        def get(request, context):
            entered.set()
            go.wait(60)
            return b"x" * ANSWER_BYTES

        server = _server(get)
        channel = grpc.insecure_channel(
            f"127.0.0.1:{server.port}", options=[("grpc.max_receive_message_length", 8 << 20)]
        )
        try:
            answer = channel.unary_unary("/test.Big/Get").future(b"", metadata=AUTH)
            assert entered.wait(60)
            go.set()
            server.stop()
            assert len(answer.result(timeout=60)) == ANSWER_BYTES, f"stop {attempt}"
        finally:
            channel.close()
            server.stop(0)
