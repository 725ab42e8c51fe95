"""The interceptor's accounting and error mapping for server-streaming RPCs (e.g. PullWeights):
status and latency are recorded when the stream ends, and an exception raised while streaming
gets the same status as one raised before the first item."""

import time

import grpc
import pytest

from services.common.config import config_from_dict
from services.common.rpc.errors import BadRequest, Unavailable
from services.common.rpc.server import RPCServer

TOKEN = "s3cret"
PAUSE_S = 0.3
METHOD = "/test.Stream/Pull"


def chunks_then(error):
    """A stream handler: two chunks PAUSE_S apart, then `error` raised (or the end)."""

    def pull(request, context):
        yield b"chunk-0"
        time.sleep(PAUSE_S)
        yield b"chunk-1"
        time.sleep(PAUSE_S)
        if error is not None:
            raise error

    return pull


@pytest.fixture()
def serve():
    """Start an RPCServer (bearer token TOKEN) serving `pull` as the stream /test.Stream/Pull;
    returns the server and a callable for the method."""
    servers, channels = [], []

    def start(pull):
        cfg = config_from_dict({"rpc": {"auth_token": TOKEN}})
        server = RPCServer("learner", cfg.rpc, port=0, host="127.0.0.1")
        server.grpc.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("test.Stream", {"Pull": grpc.unary_stream_rpc_method_handler(pull)}),)
        )
        server.start()
        servers.append(server)
        channels.append(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
        return server, channels[-1].unary_stream(METHOD)

    yield start
    for c in channels:
        c.close()
    for s in servers:
        s.stop(0)


def sample(server, name, **labels):
    return server.metrics.registry.get_sample_value(name, {"service": "learner", "method": "Pull", **labels})


@pytest.mark.parametrize(
    "error, code",
    [
        (None, grpc.StatusCode.OK),
        (BadRequest("weights: version went backwards"), grpc.StatusCode.INVALID_ARGUMENT),
        (Unavailable("snapshot store unreachable"), grpc.StatusCode.UNAVAILABLE),
        (RuntimeError("boom"), grpc.StatusCode.INTERNAL),
    ],
)
def test_stream_status_and_latency_cover_the_whole_stream(serve, caplog, error, code):
    server, pull = serve(chunks_then(error))
    received = []
    t0 = time.perf_counter()
    try:
        for item in pull(b"", metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=10):
            received.append(item)
        got = grpc.StatusCode.OK
    except grpc.RpcError as e:
        got = e.code()
        assert str(error) in e.details()
    took = time.perf_counter() - t0

    assert received == [b"chunk-0", b"chunk-1"]
    assert got == code
    assert sample(server, "rlhf_rpc_requests_total", code=code.name) == 1
    assert sample(server, "rlhf_rpc_latency_seconds_count") == 1
    assert 2 * PAUSE_S <= sample(server, "rlhf_rpc_latency_seconds_sum") <= took
    internal_logs = [r for r in caplog.records if r.name == "services.common.rpc.server" and r.exc_info]
    assert len(internal_logs) == (1 if code == grpc.StatusCode.INTERNAL else 0)


def test_stream_without_token_is_refused_before_the_handler_runs(serve):
    calls = []

    def pull(request, context):
        calls.append(1)
        yield b"chunk-0"

    server, stream = serve(pull)
    with pytest.raises(grpc.RpcError) as e:
        list(stream(b"", timeout=10))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert calls == []
    assert sample(server, "rlhf_rpc_requests_total", code="UNAUTHENTICATED") == 1


def test_stream_the_client_cancels_is_counted_as_cancelled(serve):
    server, pull = serve(chunks_then(None))
    call = pull(b"", metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=10)
    assert next(call) == b"chunk-0"
    call.cancel()
    deadline = time.monotonic() + 60
    while sample(server, "rlhf_rpc_requests_total", code="CANCELLED") is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sample(server, "rlhf_rpc_requests_total", code="CANCELLED") == 1
    assert sample(server, "rlhf_rpc_requests_total", code="OK") is None
