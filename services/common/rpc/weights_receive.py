"""Weights on the wire, the receiving side: `WeightChunkDecoder` (a piece's data decoded without
a copy) and `assemble_weights` (a push stream collected into a checked state dict)."""
from __future__ import annotations

import bisect
import hashlib
import zlib
from typing import Callable, Iterable, Mapping

import numpy as np
import torch

from .codec import DTYPE_NAMES, DTYPES, checked_shape
from .errors import BadRequest
from .gen import common_pb2 as pb
from .weights import _InOrder, _all_finite, _check_header, _raw_view, xxhash

def _read_varint(buf, i: int, end: int) -> tuple[int, int]:
    shift = value = 0
    while i < end and shift < 64:
        b = buf[i]
        value |= (b & 0x7F) << shift
        i += 1
        if not b & 0x80:
            return value, i
        shift += 7
    raise ValueError("bad varint")


class _PieceView:
    """A `WeightChunk` holding a piece, decoded without copying its data: the metadata is a
    `TensorPiece` (parsed by protobuf from the message without its data field) and `piece.data`
    a memoryview of the received message's bytes."""
    __slots__ = ("piece",)

    def __init__(self, piece):
        self.piece = piece

    @staticmethod
    def WhichOneof(group: str) -> str:  # noqa: N802 (the protobuf name)
        return "piece"


class _PieceMeta:
    __slots__ = ("_m", "data")

    def __init__(self, m: pb.TensorPiece, data: memoryview):
        self._m, self.data = m, data

    def __getattr__(self, name):
        return getattr(self._m, name)


class WeightChunkDecoder:
    """The PushWeights request deserializer: `FromString(raw)` is `WeightChunk.FromString(raw)`,
    except that a piece's data is not copied (twice: into protobuf's arena, and again on every
    read of the field) but handed on as a memoryview of `raw`. Only the plain layout (one piece
    field filling the message, at most one data field, known wire types) takes the fast path;
    anything else is parsed by protobuf itself, so what is accepted or refused is unchanged."""
    DESCRIPTOR = pb.WeightChunk.DESCRIPTOR  # the message's name in decode errors

    def FromString(self, raw: bytes):  # noqa: N802 (as protobuf's)
        try:
            view = self._fast(raw)
        except Exception:  # noqa: BLE001 (whatever is wrong, protobuf says it in its own words below)
            view = None
        return view if view is not None else pb.WeightChunk.FromString(raw)

    @staticmethod
    def _fast(raw: bytes):
        if len(raw) < (1 << 16) or raw[0] != 0x12:  # small messages: protobuf is as fast
            return None
        size, i = _read_varint(raw, 1, len(raw))
        end = len(raw)
        if i + size != end:
            return None
        start, data = i, None
        while i < end:
            tag, j = _read_varint(raw, i, end)
            field, wire = tag >> 3, tag & 7
            if wire == 0:
                _, j = _read_varint(raw, j, end)
            elif wire == 2:
                n, j = _read_varint(raw, j, end)
                if j + n > end:
                    return None
                if field == 6:
                    if data is not None:
                        return None
                    data = (i, j, j + n)  # the field starts at i, its bytes are [j, j + n)
                j += n
            elif wire == 5:
                j += 4
            elif wire == 1:
                j += 8
            else:
                return None
            if j > end:
                return None
            i = j
        if data is None:
            return None
        mv = memoryview(raw)
        meta = pb.TensorPiece.FromString(bytes(mv[start:data[0]]) + bytes(mv[data[2]:end]))
        return _PieceView(_PieceMeta(meta, mv[data[1]:data[2]]))


MAX_EMPTY_SPAN = 1 << 30  # what an empty tensor's other dimensions may span however small the push


def _check_piece(p: pb.TensorPiece, specs, header: pb.WeightHeader, max_bytes: int | None = None) -> None:
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
    # before torch.empty: no negative dimension, nothing whose product overflows (Python integers);
    # the tensor at most the header's total and the push's limit (an empty one may span a little more)
    limit = header.total_bytes if max_bytes is None else min(header.total_bytes, max_bytes)
    _, size = checked_shape(p.shape, DTYPES[p.dtype].itemsize, f"weights.piece[{p.name}]",
                            max_bytes=max(limit, MAX_EMPTY_SPAN), dtype_name=p.dtype)
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

    Checks every piece's xxh3_64 (or, from a writer without xxhash, every piece's crc32 and the
    footer's sha256 of them all: one kind per push); names/shapes/dtypes against `specs` (the
    model's state dict) and each declared size against them before allocating anything; that
    every byte of every tensor arrives exactly once (overlaps and holes are refused) and all
    pieces of a tensor agree; that format "full" covers every tensor of `specs` ("partial" may
    cover a subset); and that floating tensors are finite. `on_header(header)` runs as soon as
    the header arrives (e.g. the writer's fence), before any piece is read.

    Each tensor is allocated once, when its first piece arrives, and every piece is copied
    straight into it: the pushed bytes plus a few pieces in flight is all the memory it takes.
    sha256 and the finiteness checks run on a worker thread, in stream order, overlapping the
    receiving, piece checks and copies."""
    header = None
    buffers: dict[str, torch.Tensor] = {}  # destination tensors, allocated once from the checked specs
    views: dict[str, np.ndarray] = {}  # their raw bytes (uint8 views, no copy)
    meta: dict[str, tuple[str, tuple, int]] = {}
    spans: dict[str, list[list[int]]] = {}
    filled: dict[str, int] = {}
    digest = hashlib.sha256()
    nonfinite: set[str] = set()
    received = allocated = 0
    footer = None
    xxh3 = None  # whether this push's pieces carry xxh3 (decided by its first piece)
    worker = _InOrder(depth=4)  # holds at most a few pieces' data

    def check_finite(name: str) -> None:
        t = buffers[name]
        if t.is_floating_point() and not _all_finite(t):
            nonfinite.add(name)
    try:
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
                data = p.data  # read once: every read of a bytes field is a new copy
                n = len(data)
                has_xxh3 = p.HasField("xxh3")
                if xxh3 is None:
                    xxh3 = has_xxh3
                    if xxh3 and xxhash is None:
                        raise BadRequest("weights.piece.xxh3: this server cannot check xxh3_64 (install xxhash)")
                elif has_xxh3 != xxh3:
                    raise BadRequest(f"weights.piece[{p.name}]: xxh3 on some pieces of a push and not on others")
                if xxh3:
                    if xxhash.xxh3_64_intdigest(data) != p.xxh3:
                        raise BadRequest(f"weights.piece[{p.name}]: xxh3 mismatch at offset {p.offset}")
                elif zlib.crc32(data) != p.crc32:
                    raise BadRequest(f"weights.piece[{p.name}]: crc32 mismatch at offset {p.offset}")
                name = p.name
                if name in meta:
                    if meta[name] != (p.dtype, tuple(p.shape), p.total_bytes):
                        dtype, shape, total = meta[name]
                        raise BadRequest(f"weights.piece[{name}]: dtype {p.dtype}, shape {list(p.shape)}, total_bytes "
                                         f"{p.total_bytes} disagree with the tensor's earlier pieces ({dtype}, "
                                         f"{list(shape)}, {total})")
                else:
                    _check_piece(p, specs, header, max_bytes)
                    if len(buffers) >= header.num_tensors:
                        raise BadRequest(f"weights: more than the {header.num_tensors} tensors the header announced")
                    allocated += p.total_bytes
                    if allocated > header.total_bytes:
                        raise BadRequest(f"weights: the tensors' sizes add up to more than the header's "
                                         f"total_bytes={header.total_bytes}")
                    t = torch.empty([int(d) for d in p.shape], dtype=DTYPES[p.dtype])
                    buffers[name] = t
                    views[name] = _raw_view(t)
                    meta[name] = (p.dtype, tuple(p.shape), p.total_bytes)
                    spans[name] = []
                    filled[name] = 0
                if p.offset < 0 or p.offset + n > p.total_bytes:
                    raise BadRequest(f"weights.piece[{name}]: bytes [{p.offset}, {p.offset + n}) "
                                     f"outside the tensor's {p.total_bytes} bytes")
                _cover(spans[name], name, p.offset, p.offset + n)
                if n:
                    views[name][p.offset:p.offset + n] = np.frombuffer(data, dtype=np.uint8)
                filled[name] += n
                if not xxh3:
                    worker.submit(lambda d=data: digest.update(d))
                if filled[name] == p.total_bytes:  # complete (coverage is exact): check it meanwhile
                    worker.submit(lambda k=name: check_finite(k))
                received += n
                if max_bytes is not None and received > max_bytes:
                    raise BadRequest(f"weights: more than {max_bytes} bytes")
            elif kind == "footer":
                if footer is not None:
                    raise BadRequest("weights: a second footer in one push")
                footer = chunk.footer
            else:
                raise BadRequest("weights: an empty chunk")
    except BaseException:
        worker.abandon()
        raise
    worker.finish()
    if header is None or footer is None:
        raise BadRequest("weights: the push ended without " + ("a header" if header is None else "a footer"))
    if xxh3:
        if footer.sha256:
            raise BadRequest("weights.footer.sha256: set in a push whose pieces carry xxh3")
    elif footer.sha256 != digest.hexdigest() and not (xxh3 is None and not footer.sha256):  # None: no piece
        raise BadRequest("weights.footer.sha256: checksum mismatch; the push is incomplete or corrupt")
    if len(buffers) != header.num_tensors:
        raise BadRequest(f"weights: {len(buffers)} tensors received, header announced {header.num_tensors}")
    if header.format == "full" and specs is not None:
        missing = [k for k in specs if k not in buffers]
        if missing:
            raise BadRequest(f"weights: a full push without {len(missing)} of the model's tensors: "
                             f"{', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''} (format 'partial' "
                             f"sends a subset)")
    for name in buffers:
        size = meta[name][2]
        if filled[name] != size:
            s = spans[name]
            if not s:
                hole = (0, size)
            else:
                hole = (0, s[0][0]) if s[0][0] > 0 else (s[0][1], s[1][0] if len(s) > 1 else size)
            raise BadRequest(f"weights.piece[{name}]: {filled[name]} of {size} bytes received; "
                             f"bytes [{hole[0]}, {hole[1]}) missing")
    if allocated != header.total_bytes:
        raise BadRequest(f"weights: {allocated} bytes of tensors received, header announced "
                         f"total_bytes={header.total_bytes}")
    for name in buffers:  # every tensor is complete here, so each was checked
        if name in nonfinite:
            raise BadRequest(f"weights.piece[{name}]: contains NaN or infinity")
    state = buffers
    return int(header.version), header.format, state, received, header
