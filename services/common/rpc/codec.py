"""Tensors, token batches and weights on the wire: raw little-endian bytes in protobuf, checked
on the way in. Anything wrong raises `BadRequest` naming the field and the limit."""
from __future__ import annotations

import bisect
import hashlib
import math
import zlib
from typing import Callable, Iterable, Iterator, Mapping

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
WEIGHT_FORMATS = ("full", "partial")


def weight_chunks(state_dict: Mapping[str, torch.Tensor], version: int, chunk_bytes: int = 4 << 20,
                  fmt: str = "full", run_id: str = "", epoch: int = 0) -> Iterator[pb.WeightChunk]:
    """A state dict as a push stream: header (with the writer's run id and epoch, the fencing
    token), pieces of at most `chunk_bytes`, footer (sha256)."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    yield pb.WeightChunk(header=pb.WeightHeader(version=version, format=fmt, num_tensors=len(tensors),
                                                total_bytes=total, run_id=run_id, epoch=epoch))
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


def _nbytes(shape, dtype: torch.dtype) -> int:
    return math.prod(int(s) for s in shape) * torch.empty((), dtype=dtype).element_size()


def _check_header(h: pb.WeightHeader, specs, max_bytes: int | None) -> None:
    if h.format not in WEIGHT_FORMATS:
        raise BadRequest(f"weights.header.format: {h.format!r} is not one of {', '.join(WEIGHT_FORMATS)}")
    if h.total_bytes < 0:
        raise BadRequest(f"weights.header.total_bytes: {h.total_bytes} is negative")
    if specs is not None:
        model_bytes = sum(_nbytes(shape, dtype) for shape, dtype in specs.values())
        if h.total_bytes > model_bytes:
            raise BadRequest(f"weights.header.total_bytes: {h.total_bytes}, more than the model's {model_bytes} bytes")
        if not 1 <= h.num_tensors <= len(specs):
            raise BadRequest(f"weights.header.num_tensors: {h.num_tensors} outside [1, {len(specs)}] "
                             f"(the model's tensors)")
    elif h.num_tensors < 1:
        raise BadRequest(f"weights.header.num_tensors: {h.num_tensors}, expected at least 1")
    if max_bytes is not None and h.total_bytes > max_bytes:
        raise BadRequest(f"weights.header.total_bytes: {h.total_bytes} above the limit {max_bytes}")


def _check_piece(p: pb.TensorPiece, specs, header: pb.WeightHeader) -> None:
    """A piece's name, dtype, shape and declared sizes, before anything is allocated for it."""
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
    if any(s < 0 for s in p.shape):
        raise BadRequest(f"weights.piece[{p.name}].shape: negative dimension in {list(p.shape)}")
    size = _nbytes(p.shape, DTYPES[p.dtype])
    if p.total_bytes != size:
        raise BadRequest(f"weights.piece[{p.name}].total_bytes: {p.total_bytes}, but shape {list(p.shape)} of "
                         f"{p.dtype} is {size} bytes")
    if p.total_bytes > header.total_bytes:
        raise BadRequest(f"weights.piece[{p.name}].total_bytes: {p.total_bytes}, more than the "
                         f"header's total_bytes={header.total_bytes}")


def _cover(spans: list[list[int]], name: str, start: int, end: int) -> None:
    """Add [start, end) to a tensor's sorted, disjoint, merged covered spans; overlap is refused."""
    if end <= start:
        return
    i = bisect.bisect_right(spans, [start, end])
    if (i > 0 and spans[i - 1][1] > start) or (i < len(spans) and spans[i][0] < end):
        raise BadRequest(f"weights.piece[{name}]: bytes [{start}, {end}) were already received "
                         f"(every byte of a tensor must come exactly once)")
    if i > 0 and spans[i - 1][1] == start:
        spans[i - 1][1] = end
        if i < len(spans) and spans[i][0] == end:
            spans[i - 1][1] = spans.pop(i)[1]
    elif i < len(spans) and spans[i][0] == end:
        spans[i][0] = start
    else:
        spans.insert(i, [start, end])


def assemble_weights(chunks: Iterable[pb.WeightChunk], specs: Mapping[str, tuple[tuple, torch.dtype]] | None = None,
                     max_bytes: int | None = None, on_header: Callable[[pb.WeightHeader], None] | None = None,
                     ) -> tuple[int, str, dict[str, torch.Tensor], int, pb.WeightHeader]:
    """Collect a push stream into (version, format, state_dict, bytes, header).

    Checks every piece's crc32 and the running sha256; names/shapes/dtypes against `specs` (the
    model's state dict) and each declared size against them before allocating anything; that
    every byte of every tensor arrives exactly once (overlaps and holes are refused) and all
    pieces of a tensor agree; that format "full" covers every tensor of `specs` ("partial" may
    cover a subset); and that floating tensors are finite. `on_header(header)` runs as soon as
    the header arrives (e.g. the writer's fence), before any piece is read."""
    header = None
    buffers: dict[str, bytearray] = {}
    meta: dict[str, tuple[str, tuple, int]] = {}
    spans: dict[str, list[list[int]]] = {}
    filled: dict[str, int] = {}
    digest = hashlib.sha256()
    received = allocated = 0
    footer = None
    for chunk in chunks:
        kind = chunk.WhichOneof("payload")
        if kind == "header":
            if header is not None:
                raise BadRequest("weights: a second header in one push")
            header = chunk.header
            _check_header(header, specs, max_bytes)
            if on_header is not None:
                on_header(header)
        elif kind == "piece":
            if header is None:
                raise BadRequest("weights: a tensor piece before the header")
            if footer is not None:
                raise BadRequest("weights: a tensor piece after the footer")
            p = chunk.piece
            if zlib.crc32(p.data) != p.crc32:
                raise BadRequest(f"weights.piece[{p.name}]: crc32 mismatch at offset {p.offset}")
            if p.name in meta:
                if meta[p.name] != (p.dtype, tuple(p.shape), p.total_bytes):
                    dtype, shape, total = meta[p.name]
                    raise BadRequest(f"weights.piece[{p.name}]: dtype {p.dtype}, shape {list(p.shape)}, total_bytes "
                                     f"{p.total_bytes} disagree with the tensor's earlier pieces ({dtype}, "
                                     f"{list(shape)}, {total})")
            else:
                _check_piece(p, specs, header)
                if len(buffers) >= header.num_tensors:
                    raise BadRequest(f"weights: more than the {header.num_tensors} tensors the header announced")
                allocated += p.total_bytes
                if allocated > header.total_bytes:
                    raise BadRequest(f"weights: the tensors' sizes add up to more than the header's "
                                     f"total_bytes={header.total_bytes}")
                buffers[p.name] = bytearray(p.total_bytes)
                meta[p.name] = (p.dtype, tuple(p.shape), p.total_bytes)
                spans[p.name] = []
                filled[p.name] = 0
            if p.offset < 0 or p.offset + len(p.data) > p.total_bytes:
                raise BadRequest(f"weights.piece[{p.name}]: bytes [{p.offset}, {p.offset + len(p.data)}) "
                                 f"outside the tensor's {p.total_bytes} bytes")
            _cover(spans[p.name], p.name, p.offset, p.offset + len(p.data))
            buffers[p.name][p.offset:p.offset + len(p.data)] = p.data
            filled[p.name] += len(p.data)
            digest.update(p.data)
            received += len(p.data)
            if max_bytes is not None and received > max_bytes:
                raise BadRequest(f"weights: more than {max_bytes} bytes")
        elif kind == "footer":
            if footer is not None:
                raise BadRequest("weights: a second footer in one push")
            footer = chunk.footer
        else:
            raise BadRequest("weights: an empty chunk")
    if header is None or footer is None:
        raise BadRequest("weights: the push ended without " + ("a header" if header is None else "a footer"))
    if footer.sha256 != digest.hexdigest():
        raise BadRequest("weights.footer.sha256: checksum mismatch; the push is incomplete or corrupt")
    if len(buffers) != header.num_tensors:
        raise BadRequest(f"weights: {len(buffers)} tensors received, header announced {header.num_tensors}")
    if header.format == "full" and specs is not None:
        missing = [k for k in specs if k not in buffers]
        if missing:
            raise BadRequest(f"weights: a full push without {len(missing)} of the model's tensors: "
                             f"{', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''} (format 'partial' "
                             f"sends a subset)")
    for name, buf in buffers.items():
        if filled[name] != len(buf):
            s = spans[name]
            if not s:
                hole = (0, len(buf))
            else:
                hole = (0, s[0][0]) if s[0][0] > 0 else (s[0][1], s[1][0] if len(s) > 1 else len(buf))
            raise BadRequest(f"weights.piece[{name}]: {filled[name]} of {len(buf)} bytes received; "
                             f"bytes [{hole[0]}, {hole[1]}) missing")
    if allocated != header.total_bytes:
        raise BadRequest(f"weights: {allocated} bytes of tensors received, header announced "
                         f"total_bytes={header.total_bytes}")
    state = {}
    for name in list(buffers):
        dtype, shape, _ = meta[name]
        t = bytes_to_tensor(buffers.pop(name), dtype, shape, f"weights.piece[{name}]")
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise BadRequest(f"weights.piece[{name}]: contains NaN or infinity")
        state[name] = t
    return int(header.version), header.format, state, received, header
