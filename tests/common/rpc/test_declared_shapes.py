"""Declared tensor shapes are checked in Python integers before torch or numpy builds anything
from them: shapes whose product overflows 64 bits (or wraps to a small number), an empty tensor
beside huge dimensions, too many dimensions, all refused with `BadRequest` (INVALID_ARGUMENT) by
the codec (critic Values/Train), a weight push with or without the model's specs, and a
shared-memory weights file. tests/e2e/test_fuzz.py sends the same over gRPC."""

import json
import math

import pytest
import torch

from services.common.rpc.codec import MAX_NDIM, bytes_to_tensor, checked_shape, tensor_from_proto
from services.common.rpc.errors import BadRequest
from services.common.rpc.gen import common_pb2 as pb
from services.weights import shm
from services.weights.assemble import assemble_weights
from services.weights.stream import StreamSpec, weight_chunks
from tests.grpc_helpers import restream

OVERFLOWING = [
    [0, 2**62, 2**62],  # empty; torch: "Stride calculation overflowed"
    [0, 2**63 - 1, 2],
    [2**62, 2**62, 0],  # torch: "numel: integer multiplication overflow"
    [2**32, 2**32],  # wraps to 0 in 64-bit arithmetic
    [2**62, 4],
    [2**61, 8],
    [2**63 - 1, 0],
    [0, 2**31, 2**31, 2**31],
    [1] * (MAX_NDIM + 1),
    [-1, 4],
    [4, -(2**63)],
]


def _wrapped(shape, itemsize):
    """The byte count 64-bit arithmetic gets (what a check in C integers would compare against)."""
    n = (math.prod(shape) * itemsize) % 2**64
    return n if n <= 1 << 16 else 0


@pytest.mark.parametrize("shape", OVERFLOWING)
@pytest.mark.parametrize("dtype,itemsize", [("float32", 4), ("int64", 8), ("bfloat16", 2), ("bool", 1)])
def test_the_codec_refuses_overflowing_shapes_before_building_a_tensor(shape, dtype, itemsize):
    for data in (b"", bytes(_wrapped(shape, itemsize)), bytes(8)):
        with pytest.raises(BadRequest, match=r"^returns"):
            bytes_to_tensor(data, dtype, shape, "returns")
        msg = pb.Tensor(dtype=dtype, shape=shape, data=data)
        with pytest.raises(BadRequest, match=r"^returns"):
            tensor_from_proto(msg, "returns", ndim=len(shape))


def test_checked_shape_counts_in_python_integers():
    assert checked_shape([3, 4], 4, "x", nbytes=48) == ([3, 4], 48)
    assert checked_shape([0, 4096], 4, "x", nbytes=0) == ([0, 4096], 0)  # an ordinary empty tensor
    assert checked_shape([], 8, "x", nbytes=8) == ([], 8)
    with pytest.raises(BadRequest, match=r"x: 47 bytes do not fit shape \[3, 4\] of float32 \(48 bytes\)"):
        checked_shape([3, 4], 4, "x", nbytes=47, dtype_name="float32")
    with pytest.raises(BadRequest, match=r"spans more than 1000 bytes"):
        checked_shape([0, 251], 4, "x", max_bytes=1000)  # an empty tensor too: its other dims count
    with pytest.raises(BadRequest, match=r"9 dimensions, more than 8"):
        checked_shape([1] * 9, 4, "x")


def test_a_configured_limit_bounds_a_tensor_below_the_wire_maximum():
    t = pb.Tensor(dtype="float32", shape=[0, 1 << 20], data=b"")
    assert tensor_from_proto(t, "v").shape == (0, 1 << 20)
    with pytest.raises(BadRequest, match="spans more than 1048576 bytes"):
        tensor_from_proto(t, "v", max_bytes=1 << 20)


STATE = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4), "e": torch.zeros(0, 3)}
SPECS = {k: (tuple(t.shape), t.dtype) for k, t in STATE.items()}


@pytest.mark.parametrize("specs", [SPECS, None])
@pytest.mark.parametrize("shape", OVERFLOWING)
def test_a_push_refuses_overflowing_piece_shapes(specs, shape):
    for total in {_wrapped(shape, 4), 0, 48}:
        chunks = list(weight_chunks(STATE, StreamSpec(1, chunk_bytes=1 << 20)))
        piece = next(c.piece for c in chunks if c.WhichOneof("payload") == "piece" and c.piece.name == "e")
        piece.shape[:] = shape
        piece.total_bytes = total
        with pytest.raises(BadRequest, match=r"weights\.piece\[e\]"):
            assemble_weights(iter(restream(chunks)), specs, max_bytes=1 << 30)


def test_a_push_without_specs_still_takes_an_ordinary_empty_tensor():
    policy_version, _, state, _, _ = assemble_weights(iter(restream(list(weight_chunks(STATE, StreamSpec(2))))), None)
    assert policy_version == 2 and state["e"].shape == (0, 3) and torch.equal(state["a"], STATE["a"])


@pytest.mark.parametrize("shape", [s for s in OVERFLOWING if min(s) >= 0 and len(s) <= MAX_NDIM])
def test_a_shared_memory_file_with_an_overflowing_shape_is_refused(shape):
    wrapped = _wrapped(shape, 4)
    header = json.dumps(
        {"__metadata__": {}, "e": {"dtype": "F32", "shape": shape, "data_offsets": [0, wrapped]}}
    ).encode()
    buf = len(header).to_bytes(8, "little") + header + bytes(wrapped)
    with pytest.raises(BadRequest, match=r"shm\[f\]: tensor 'e'"):
        shm._parse(buf, len(buf), "shm[f]")
