"""Helpers for tests of the gRPC servers."""
import grpc
import pytest

TOKEN = "s3cret"


def expect_code(fn, code, fragment=""):
    """Call fn, expect an RpcError with `code` whose details contain `fragment`; its details."""
    with pytest.raises(grpc.RpcError) as e:
        fn()
    assert e.value.code() == code, e.value.details()
    assert fragment in (e.value.details() or ""), e.value.details()
    return e.value.details()
