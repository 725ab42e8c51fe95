"""The interceptor's answers to what clients and servicers get wrong: request bytes that are not
the method's message are INVALID_ARGUMENT without a traceback (unary and client-streaming); the
exceptions of errors.py and the input-driven RecursionError / OverflowError get their own
status; INTERNAL logs its traceback once per method, exception type and raising line."""

import logging

import grpc
import pytest

from services.common.config import config_from_dict
from services.common.rpc.errors import (
    BadRequest,
    DeadlineExceeded,
    ErrorDetails,
    Reason,
    ResourceExhausted,
    Unavailable,
    Violation,
    details_of,
    reason_of,
)
from services.common.rpc.gen import reward_pb2 as rpb
from services.common.rpc.server import RPCServer

TOKEN = "s3cret"
MD = (("authorization", f"Bearer {TOKEN}"),)
GARBAGE = b"\xff\xff\xff\xff\x0f"  # not protobuf wire format
BAD_UTF8 = b"\x0a\x04\x0a\x02\xc3\x28"  # samples[0].prompt: invalid UTF-8 in a string field


@pytest.fixture()
def served():
    """A real RPCServer serving /test.Echo/{Unary,Push,Pull} on ScoreRequest messages; each
    handler records what it received, and Unary raises `served.raise_` when it is set."""
    cfg = config_from_dict({"rpc": {"auth_token": TOKEN}})
    server = RPCServer("reward", cfg.rpc, port=0, host="127.0.0.1")
    state = type("State", (), {"received": [], "raise_": None})()

    def unary(request, context):
        state.received.append(request)
        if state.raise_ is not None:
            raise state.raise_
        return rpb.ScoreResponse()

    def push(request_iterator, context):
        for r in request_iterator:
            state.received.append(r)
        return rpb.ScoreResponse()

    def pull(request, context):
        state.received.append(request)
        yield rpb.ScoreResponse()

    kw = dict(request_deserializer=rpb.ScoreRequest.FromString, response_serializer=rpb.ScoreResponse.SerializeToString)
    server.grpc.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "test.Echo",
                {
                    "Unary": grpc.unary_unary_rpc_method_handler(unary, **kw),
                    "Push": grpc.stream_unary_rpc_method_handler(push, **kw),
                    "Pull": grpc.unary_stream_rpc_method_handler(pull, **kw),
                },
            ),
        )
    )
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    state.server, state.channel = server, channel
    yield state
    channel.close()
    server.stop(0)


def _errors(caplog):
    return [r for r in caplog.records if r.levelno >= logging.ERROR]


def _code(fn):
    try:
        fn()
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize("data", [GARBAGE, BAD_UTF8])
def test_undecodable_unary_request_is_invalid_argument_without_a_traceback(served, caplog, data):
    call = served.channel.unary_unary("/test.Echo/Unary")  # raw bytes, no serializer
    for _ in range(3):
        code, details = _code(lambda: call(data, metadata=MD, timeout=10))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert details.startswith("request: not a valid ScoreRequest (")
    assert served.received == []
    assert _errors(caplog) == []
    assert (
        served.server.metrics.registry.get_sample_value(
            "rlhf_rpc_requests_total", {"service": "reward", "method": "Unary", "code": "INVALID_ARGUMENT"}
        )
        == 3
    )
    # a good message still goes through, and without the token garbage is refused before decoding matters
    assert _code(lambda: call(rpb.ScoreRequest().SerializeToString(), metadata=MD, timeout=10))[0] == grpc.StatusCode.OK
    assert _code(lambda: call(GARBAGE, timeout=10))[0] == grpc.StatusCode.UNAUTHENTICATED


def test_undecodable_message_of_a_client_stream_is_invalid_argument(served, caplog):
    good = rpb.ScoreRequest(samples=[rpb.RewardSample(prompt="p")]).SerializeToString()
    call = served.channel.stream_unary("/test.Echo/Push")
    code, details = _code(lambda: call(iter([good, GARBAGE, good]), metadata=MD, timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert "not a valid ScoreRequest" in details
    assert [r.samples[0].prompt for r in served.received] == ["p"]  # the servicer stopped at the bad one
    assert _errors(caplog) == []


def test_undecodable_request_of_a_server_stream_is_invalid_argument(served, caplog):
    call = served.channel.unary_stream("/test.Echo/Pull")
    code, details = _code(lambda: list(call(GARBAGE, metadata=MD, timeout=10)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert served.received == [] and _errors(caplog) == []


@pytest.mark.parametrize(
    "error, code",
    [
        (BadRequest("samples: empty"), grpc.StatusCode.INVALID_ARGUMENT),
        (Unavailable("reward API down"), grpc.StatusCode.UNAVAILABLE),
        (ResourceExhausted("prompts x n x tokens above the limit"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (DeadlineExceeded("the caller's deadline passed"), grpc.StatusCode.DEADLINE_EXCEEDED),
        (
            RecursionError("maximum recursion depth exceeded while decoding a JSON array"),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (OverflowError("Python int too large to convert to C long"), grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_exceptions_map_to_their_status(served, caplog, error, code):
    served.raise_ = error
    call = served.channel.unary_unary("/test.Echo/Unary")
    got, details = _code(lambda: call(b"", metadata=MD, timeout=10))
    assert got == code and str(error) in details
    assert _errors(caplog) == []


def test_internal_traceback_is_logged_once_per_method_type_and_line(served, caplog):
    call = served.channel.unary_unary("/test.Echo/Unary")
    served.raise_ = RuntimeError("boom")
    for _ in range(3):
        assert _code(lambda: call(b"", metadata=MD, timeout=10))[0] == grpc.StatusCode.INTERNAL
    served.raise_ = KeyError("other")  # another exception type: its traceback once too
    for _ in range(2):
        assert _code(lambda: call(b"", metadata=MD, timeout=10))[0] == grpc.StatusCode.INTERNAL
    logged = [r for r in _errors(caplog) if r.name == "services.common.rpc.server"]
    assert len(logged) == 5
    assert [r.exc_info is not None for r in logged] == [True, False, False, True, False]
    assert "RuntimeError: boom" in logged[1].getMessage() and "traceback logged once" in logged[1].getMessage()


def test_a_reason_and_a_field_travel_as_standard_error_details(served):
    """`google.rpc.ErrorInfo` (the reason, in this system's domain) and `google.rpc.BadRequest`
    (the field) in the status: what callers act on, whatever the message says; the request id
    stays in the trailer beside them."""
    call = served.channel.unary_unary(
        "/test.Echo/Unary",
        request_serializer=rpb.ScoreRequest.SerializeToString,
        response_deserializer=rpb.ScoreResponse.FromString,
    )
    served.raise_ = BadRequest(
        "prompts[2]: reworded at will", Reason.PROMPT_INVALID, field="prompts[2]", metadata={"index": "2"}
    )
    with pytest.raises(grpc.RpcError) as e:
        call(rpb.ScoreRequest(), metadata=MD, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details() == "prompts[2]: reworded at will"
    assert details_of(e.value) == ErrorDetails(
        Reason.PROMPT_INVALID, {"index": "2"}, (Violation("prompts[2]", "prompts[2]: reworded at will"),)
    )
    assert dict(e.value.trailing_metadata())["x-request-id"]
    served.raise_ = Unavailable("reward API failed: HTTP 500", Reason.REWARD_API_FAILED)
    with pytest.raises(grpc.RpcError) as e:
        call(rpb.ScoreRequest(), metadata=MD, timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and reason_of(e.value) is Reason.REWARD_API_FAILED
    served.raise_ = BadRequest("no reason given")  # a plain error: no details at all
    with pytest.raises(grpc.RpcError) as e:
        call(rpb.ScoreRequest(), metadata=MD, timeout=10)
    assert details_of(e.value) == ErrorDetails()
    assert details_of(ValueError("PROMPT_INVALID")) == ErrorDetails()  # not a call: nothing to read


def test_a_reason_of_another_domain_is_not_ours(served):
    """An ErrorInfo from another system (a proxy, a different service) with a reason spelled like
    ours is not taken for ours."""
    from google.protobuf import any_pb2
    from google.rpc import error_details_pb2, status_pb2
    from grpc_status import rpc_status

    def foreign(request, context):
        detail = any_pb2.Any()
        detail.Pack(error_details_pb2.ErrorInfo(reason="PROMPT_INVALID", domain="example.com"))
        context.abort_with_status(
            rpc_status.to_status(
                status_pb2.Status(code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message="theirs", details=[detail])
            )
        )

    server = grpc.server(__import__("concurrent.futures").futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("test.Foreign", {"Unary": grpc.unary_unary_rpc_method_handler(foreign)}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.RpcError) as e:
                channel.unary_unary("/test.Foreign/Unary")(b"", timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and reason_of(e.value) is None
    finally:
        server.stop(0)


def test_a_long_non_ascii_message_keeps_its_status_reason_and_last_line(served):
    """A reward function's traceback quoting a model's reply in Cyrillic: the message goes twice
    into the trailer (grpc-message writes each non-ASCII byte as three), so it is cut to a byte
    budget, keeping its start and its end (the line that says what was raised); the status and
    its reason arrive whole, 20 times in a row (past the trailer limit gRPC drops a status at random)."""
    from services.common.rpc.client import client_channel
    from services.common.rpc.errors import FailedPrecondition

    reply = "Ответ модели: " * 300  # ~4,000 characters, ~7,800 UTF-8 bytes
    served.raise_ = FailedPrecondition(
        f"reward function 'r.py:f' raised\n{reply}\nValueError: последняя строка", Reason.REWARD_FUNCTION_FAILED
    )
    cfg = config_from_dict({"rpc": {"auth_token": TOKEN}})
    channel = client_channel(f"127.0.0.1:{served.server.port}", cfg.rpc)
    call = channel.unary_unary(
        "/test.Echo/Unary",
        request_serializer=rpb.ScoreRequest.SerializeToString,
        response_deserializer=rpb.ScoreResponse.FromString,
    )
    try:
        for _ in range(20):
            with pytest.raises(grpc.RpcError) as e:
                call(rpb.ScoreRequest(), metadata=MD, timeout=10)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value.details()
            assert reason_of(e.value) is Reason.REWARD_FUNCTION_FAILED
            details = e.value.details()
            assert details.startswith("reward function 'r.py:f' raised") and "bytes, cut" in details
            assert details.endswith("ValueError: последняя строка") and len(details.encode()) <= 1200
    finally:
        channel.close()
