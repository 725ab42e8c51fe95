"""Tensors, token batches and weights on the wire: raw little-endian bytes in protobuf, checked
on the way in. Anything wrong raises `BadRequest` naming the field and the limit."""
from __future__ import annotations

import hashlib
import math
import zlib
from typing import Iterable, Iterator, Mapping

import numpy as np
import torch

from ..modeling import TokenBatch
from .errors import BadRequest
from .gen import common_pb2 as pb

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
          "int64": torch.int64, "int32": torch.int32, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def tensor_to_proto(t: torch.Tensor) -> pb.Tensor:
    t = t.detach().cpu().contiguous()
    if t.dtype not in DTYPE_NAMES:
        raise TypeError(f"dtype {t.dtype} cannot go on the wire")
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    return pb.Tensor(dtype=DTYPE_NAMES[t.dtype], shape=list(t.shape), data=raw.numpy().tobytes())


def bytes_to_tensor(data: bytes, dtype_name: str, shape, field: str) -> torch.Tensor:
    if dtype_name not in DTYPES:
        raise BadRequest(f"{field}.dtype: {dtype_name!r} is not one of {', '.join(DTYPES)}")
    dtype = DTYPES[dtype_name]
    shape = [int(s) for s in shape]
    if any(s < 0 for s in shape):
        raise BadRequest(f"{field}.shape: negative dimension in {shape}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = math.prod(shape) * itemsize
    if len(data) != expected:
        raise BadRequest(f"{field}: {len(data)} bytes do not fit shape {shape} of {dtype_name} ({expected} bytes)")
    if dtype == torch.bfloat16:
        arr = np.frombuffer(data, dtype=np.int16).copy()
        return torch.from_numpy(arr).view(torch.bfloat16).reshape(shape)
    np_dtype = torch.empty((), dtype=dtype).numpy().dtype
    return torch.from_numpy(np.frombuffer(data, dtype=np_dtype).copy()).reshape(shape)


def tensor_from_proto(msg: pb.Tensor, field: str, dtype: torch.dtype | None = None, ndim: int | None = None,
                      finite: bool = True) -> torch.Tensor:
    if not msg.dtype:
        raise BadRequest(f"{field}: missing")
    t = bytes_to_tensor(msg.data, msg.dtype, msg.shape, field)
    if ndim is not None and t.dim() != ndim:
        raise BadRequest(f"{field}: expected {ndim} dimensions, got shape {list(t.shape)}")
    if finite and t.is_floating_point() and not torch.isfinite(t).all():
        raise BadRequest(f"{field}: contains NaN or infinity")
    return t.to(dtype) if dtype is not None else t


def batch_to_proto(b: TokenBatch) -> pb.TokenBatch:
    return pb.TokenBatch(input_ids=tensor_to_proto(b.input_ids.to(torch.int32)),
                         attention_mask=tensor_to_proto(b.attention_mask.to(torch.int8)),
                         position_ids=tensor_to_proto(b.position_ids.to(torch.int32)),
                         response_mask=tensor_to_proto(b.response_mask.to(torch.int8)),
                         prompt_width=b.prompt_width)


def batch_from_proto(msg: pb.TokenBatch, vocab_size: int, max_prompt: int, max_response: int,
                     max_batch: int = 1 << 16) -> TokenBatch:
    """Decode and check a token batch: shapes agree, ids inside the vocabulary, lengths in limits."""
    ids = tensor_from_proto(msg.input_ids, "batch.input_ids", torch.long, ndim=2)
    attn = tensor_from_proto(msg.attention_mask, "batch.attention_mask", torch.long, ndim=2)
    pos = tensor_from_proto(msg.position_ids, "batch.position_ids", torch.long, ndim=2)
    rmask = tensor_from_proto(msg.response_mask, "batch.response_mask", torch.float32, ndim=2)
    B, L = ids.shape
    P = int(msg.prompt_width)
    if B == 0:
        raise BadRequest("batch: empty (0 sequences)")
    if B > max_batch:
        raise BadRequest(f"batch: {B} sequences, more than the limit {max_batch}")
    if attn.shape != ids.shape or pos.shape != ids.shape:
        raise BadRequest(f"batch: attention_mask {list(attn.shape)} / position_ids {list(pos.shape)} "
                         f"must match input_ids {list(ids.shape)}")
    if not 1 <= P < L or rmask.shape != (B, L - P):
        raise BadRequest(f"batch.prompt_width: {P} with input width {L} and response_mask {list(rmask.shape)}")
    if P > max_prompt:
        raise BadRequest(f"batch.prompt_width: {P} is more than prompt_length={max_prompt}")
    if L - P > max_response:
        raise BadRequest(f"batch.response_mask: {L - P} response positions, more than response_length={max_response}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise BadRequest(f"batch.input_ids: token id {int(ids.max() if ids.max() >= vocab_size else ids.min())} "
                         f"outside the vocabulary [0, {vocab_size})")
    return TokenBatch(ids, attn, pos, rmask, P)


# ------------------------------------------------------------------ weights
def weight_chunks(state_dict: Mapping[str, torch.Tensor], version: int, chunk_bytes: int = 4 << 20,
                  fmt: str = "full") -> Iterator[pb.WeightChunk]:
    """A state dict as a push stream: header, pieces of at most `chunk_bytes`, footer (sha256)."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    yield pb.WeightChunk(header=pb.WeightHeader(version=version, format=fmt, num_tensors=len(tensors),
                                                total_bytes=total))
    digest = hashlib.sha256()
    for name, t in tensors.items():
        raw = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
        for off in range(0, max(len(raw), 1), chunk_bytes):
            data = raw[off:off + chunk_bytes]
            digest.update(data)
            yield pb.WeightChunk(piece=pb.TensorPiece(name=name, dtype=DTYPE_NAMES[t.dtype], shape=list(t.shape),
                                                      offset=off, total_bytes=len(raw), data=data,
                                                      crc32=zlib.crc32(data)))
    yield pb.WeightChunk(footer=pb.WeightFooter(sha256=digest.hexdigest()))


def assemble_weights(chunks: Iterable[pb.WeightChunk], specs: Mapping[str, tuple[tuple, torch.dtype]] | None = None,
                     max_bytes: int | None = None) -> tuple[int, str, dict[str, torch.Tensor], int]:
    """Collect a push stream into (version, format, state_dict, bytes), checking every piece's
    crc32, the running sha256, names/shapes/dtypes against `specs`, and completeness."""
    header = None
    buffers: dict[str, bytearray] = {}
    meta: dict[str, tuple[str, list]] = {}
    filled: dict[str, int] = {}
    digest = hashlib.sha256()
    received = 0
    footer = None
    for chunk in chunks:
        kind = chunk.WhichOneof("payload")
        if kind == "header":
            if header is not None:
                raise BadRequest("weights: a second header in one push")
            header = chunk.header
            if max_bytes is not None and header.total_bytes > max_bytes:
                raise BadRequest(f"weights.header.total_bytes: {header.total_bytes} above the limit {max_bytes}")
        elif kind == "piece":
            if header is None:
                raise BadRequest("weights: a tensor piece before the header")
            if footer is not None:
                raise BadRequest("weights: a tensor piece after the footer")
            p = chunk.piece
            if zlib.crc32(p.data) != p.crc32:
                raise BadRequest(f"weights.piece[{p.name}]: crc32 mismatch at offset {p.offset}")
            if specs is not None:
                if p.name not in specs:
                    raise BadRequest(f"weights.piece.name: unknown tensor {p.name!r}")
                want_shape, want_dtype = specs[p.name]
                if tuple(p.shape) != tuple(want_shape):
                    raise BadRequest(f"weights.piece[{p.name}].shape: {list(p.shape)}, expected {list(want_shape)}")
                if DTYPES.get(p.dtype) != want_dtype:
                    raise BadRequest(f"weights.piece[{p.name}].dtype: {p.dtype}, expected {DTYPE_NAMES.get(want_dtype)}")
            if p.dtype not in DTYPES:
                raise BadRequest(f"weights.piece[{p.name}].dtype: {p.dtype!r} unknown")
            if p.name not in buffers:
                buffers[p.name] = bytearray(p.total_bytes)
                meta[p.name] = (p.dtype, list(p.shape))
                filled[p.name] = 0
            buf = buffers[p.name]
            if p.offset < 0 or p.offset + len(p.data) > len(buf):
                raise BadRequest(f"weights.piece[{p.name}]: bytes [{p.offset}, {p.offset + len(p.data)}) "
                                 f"outside the tensor's {len(buf)} bytes")
            buf[p.offset:p.offset + len(p.data)] = p.data
            filled[p.name] += len(p.data)
            digest.update(p.data)
            received += len(p.data)
            if max_bytes is not None and received > max_bytes:
                raise BadRequest(f"weights: more than {max_bytes} bytes")
        elif kind == "footer":
            footer = chunk.footer
        else:
            raise BadRequest("weights: an empty chunk")
    if header is None or footer is None:
        raise BadRequest("weights: the push ended without " + ("a header" if header is None else "a footer"))
    if footer.sha256 != digest.hexdigest():
        raise BadRequest("weights.footer.sha256: checksum mismatch; the push is incomplete or corrupt")
    if len(buffers) != header.num_tensors:
        raise BadRequest(f"weights: {len(buffers)} tensors received, header announced {header.num_tensors}")
    state = {}
    for name, buf in buffers.items():
        if filled[name] != len(buf):
            raise BadRequest(f"weights.piece[{name}]: {filled[name]} of {len(buf)} bytes received")
        dtype, shape = meta[name]
        state[name] = bytes_to_tensor(bytes(buf), dtype, shape, f"weights.piece[{name}]")
    return int(header.version), header.format or "full", state, received
