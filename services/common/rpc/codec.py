"""Tensors and token batches on the wire: raw little-endian bytes in protobuf, checked on the way
in. Anything wrong raises `BadRequest` naming the field and the limit. Weights have a package of
their own, `services/weights/` (the push stream, shared memory, the checks of a version)."""

from __future__ import annotations

import math

import numpy as np
import torch

from ..modeling import TokenBatch
from .errors import BadRequest
from .gen import common_pb2 as pb

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

MAX_NDIM = 8  # more dimensions than any tensor of the system has (batches 2, weights at most 4)
# a tensor on the wire lies inside one gRPC message, and rpc.max_message_mb is at most 2047
MAX_WIRE_TENSOR_BYTES = 2047 << 20


def checked_shape(
    shape,
    itemsize: int,
    field: str,
    nbytes: int | None = None,
    max_bytes: int | None = None,
    dtype_name: str | None = None,
) -> tuple[list[int], int]:
    """A declared shape checked before anything (torch, numpy) is built from it: at most
    `MAX_NDIM` dimensions, none negative, and the bytes the shape spans, with every dimension
    counted as at least 1, at most `max_bytes` (default `MAX_WIRE_TENSOR_BYTES`): so an empty
    tensor cannot declare dimensions whose product overflows torch's int64 numel or strides.
    All in Python integers; with `nbytes` (the payload's or the declared size) the shape's
    bytes must equal it. Returns (the dimensions as ints, the tensor's bytes)."""
    dims = [int(s) for s in shape]
    of = dtype_name or f"{itemsize}-byte elements"
    if len(dims) > MAX_NDIM:
        raise BadRequest(f"{field}.shape: {len(dims)} dimensions, more than {MAX_NDIM}")
    if any(d < 0 for d in dims):
        raise BadRequest(f"{field}.shape: negative dimension in {dims}")
    limit = MAX_WIRE_TENSOR_BYTES if max_bytes is None else max_bytes
    span = itemsize
    for d in dims:
        span *= max(d, 1)
        if span > limit:
            raise BadRequest(
                f"{field}.shape: {dims} of {of} spans more than {limit} bytes (every dimension counted as at least 1)"
            )
    size = math.prod(dims) * itemsize
    if nbytes is not None and nbytes != size:
        raise BadRequest(f"{field}: {nbytes} bytes do not fit shape {dims} of {of} ({size} bytes)")
    return dims, size


def tensor_to_proto(t: torch.Tensor) -> pb.Tensor:
    t = t.detach().cpu().contiguous()
    if t.dtype not in DTYPE_NAMES:
        raise TypeError(f"dtype {t.dtype} cannot go on the wire")
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    return pb.Tensor(dtype=DTYPE_NAMES[t.dtype], shape=list(t.shape), data=raw.numpy().tobytes())


def bytes_to_tensor(
    data: bytes, dtype_name: str, shape, field: str, ndim: int | None = None, max_bytes: int | None = None
) -> torch.Tensor:
    """A tensor from raw bytes; dtype, the number of dimensions (`ndim`, when given) and the
    shape (`checked_shape`) are checked before anything is built."""
    if dtype_name not in DTYPES:
        raise BadRequest(f"{field}.dtype: {dtype_name!r} is not one of {', '.join(DTYPES)}")
    dtype = DTYPES[dtype_name]
    if ndim is not None and len(shape) != ndim:
        raise BadRequest(f"{field}: expected {ndim} dimensions, got shape {[int(s) for s in shape][: MAX_NDIM + 1]}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    shape, _ = checked_shape(shape, itemsize, field, nbytes=len(data), max_bytes=max_bytes, dtype_name=dtype_name)
    if dtype == torch.bfloat16:
        arr = np.frombuffer(data, dtype=np.int16).copy()
        return torch.from_numpy(arr).view(torch.bfloat16).reshape(shape)
    np_dtype = torch.empty((), dtype=dtype).numpy().dtype
    return torch.from_numpy(np.frombuffer(data, dtype=np_dtype).copy()).reshape(shape)


def tensor_from_proto(
    msg: pb.Tensor,
    field: str,
    dtype: torch.dtype | None = None,
    ndim: int | None = None,
    finite: bool = True,
    max_bytes: int | None = None,
) -> torch.Tensor:
    """`max_bytes`: the most a tensor may span (a server passes its rpc.max_message_mb)."""
    if not msg.dtype:
        raise BadRequest(f"{field}: missing")
    t = bytes_to_tensor(msg.data, msg.dtype, msg.shape, field, ndim=ndim, max_bytes=max_bytes)
    if finite and t.is_floating_point() and not torch.isfinite(t).all():
        raise BadRequest(f"{field}: contains NaN or infinity")
    return t.to(dtype) if dtype is not None else t


def batch_to_proto(b: TokenBatch) -> pb.TokenBatch:
    return pb.TokenBatch(
        input_ids=tensor_to_proto(b.input_ids.to(torch.int32)),
        attention_mask=tensor_to_proto(b.attention_mask.to(torch.int8)),
        position_ids=tensor_to_proto(b.position_ids.to(torch.int32)),
        response_mask=tensor_to_proto(b.response_mask.to(torch.int8)),
        prompt_width=b.prompt_width,
    )


def batch_from_proto(
    msg: pb.TokenBatch,
    vocab_size: int,
    max_prompt: int,
    max_response: int,
    max_batch: int = 1 << 16,
    max_bytes: int | None = None,
) -> TokenBatch:
    """Decode and check a token batch: shapes agree, ids inside the vocabulary, lengths in limits."""
    ids = tensor_from_proto(msg.input_ids, "batch.input_ids", torch.long, ndim=2, max_bytes=max_bytes)
    attn = tensor_from_proto(msg.attention_mask, "batch.attention_mask", torch.long, ndim=2, max_bytes=max_bytes)
    pos = tensor_from_proto(msg.position_ids, "batch.position_ids", torch.long, ndim=2, max_bytes=max_bytes)
    rmask = tensor_from_proto(msg.response_mask, "batch.response_mask", torch.float32, ndim=2, max_bytes=max_bytes)
    B, L = ids.shape
    P = int(msg.prompt_width)
    if B == 0:
        raise BadRequest("batch: empty (0 sequences)")
    if B > max_batch:
        raise BadRequest(f"batch: {B} sequences, more than the limit {max_batch}")
    if attn.shape != ids.shape or pos.shape != ids.shape:
        raise BadRequest(
            f"batch: attention_mask {list(attn.shape)} / position_ids {list(pos.shape)} "
            f"must match input_ids {list(ids.shape)}"
        )
    if not 1 <= P < L or rmask.shape != (B, L - P):
        raise BadRequest(f"batch.prompt_width: {P} with input width {L} and response_mask {list(rmask.shape)}")
    if P > max_prompt:
        raise BadRequest(f"batch.prompt_width: {P} is more than prompt_length={max_prompt}")
    if L - P > max_response:
        raise BadRequest(f"batch.response_mask: {L - P} response positions, more than response_length={max_response}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise BadRequest(
            f"batch.input_ids: token id {int(ids.max() if ids.max() >= vocab_size else ids.min())} "
            f"outside the vocabulary [0, {vocab_size})"
        )
    return TokenBatch(ids, attn, pos, rmask, P)
