"""Helpers for tests of the gRPC servers."""
import hashlib

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


def restream(chunks):
    """Weight-push `chunks` (a list) with the footer's sha256 recomputed, so that only the tampering
    under test is wrong; returns the list."""
    digest = hashlib.sha256()
    for c in chunks:
        if c.WhichOneof("payload") == "piece":
            digest.update(c.piece.data)
    chunks[-1].footer.sha256 = digest.hexdigest()
    return chunks
