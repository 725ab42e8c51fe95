"""Weights over gRPC, the receiver's end: a push stream's pieces (decoded without a copy by
`WeightChunkDecoder`, the PushWeights deserializer in decoder.py) collected into a checked state
dict (`assemble_weights`: every piece's checksum, exact coverage of every tensor, finite floats,
the header's fence; a DELTA decoded against the base this server holds). The sender's end is
stream.py."""

from __future__ import annotations

import bisect
import hashlib
import zlib
from functools import partial
from typing import Callable, Iterable, Mapping

import numpy as np
import torch

from ..common.rpc.codec import DTYPES, checked_shape
from ..common.rpc.errors import BadRequest, FailedPrecondition, Reason
from ..common.rpc.gen import common_pb2 as pb
from . import delta
from .check import all_finite, check_coverage, check_header, check_tensor
from .protocol import STREAM_FORMATS, InOrder, PushKind, raw_view, xxhash

MAX_EMPTY_SPAN = 1 << 30  # what an empty tensor's other dimensions may span however small the push


def _check_piece(p: pb.TensorPiece, specs, header: pb.WeightHeader, max_bytes: int | None = None) -> None:
    """A piece's name, dtype, shape and declared sizes, before anything is allocated for it."""
    if specs is not None:
        check_tensor(p.name, p.shape, p.dtype, specs, f"weights.piece[{p.name}]")
    if p.dtype not in DTYPES:
        raise BadRequest(f"weights.piece[{p.name}].dtype: {p.dtype!r} unknown")
    # before torch.empty: no negative dimension, nothing whose product overflows (Python integers);
    # the tensor at most the header's total and the push's limit (an empty one may span a little more)
    limit = header.total_bytes if max_bytes is None else min(header.total_bytes, max_bytes)
    _, size = checked_shape(
        p.shape,
        DTYPES[p.dtype].itemsize,
        f"weights.piece[{p.name}]",
        max_bytes=max(limit, MAX_EMPTY_SPAN),
        dtype_name=p.dtype,
    )
    if p.total_bytes != size:
        raise BadRequest(
            f"weights.piece[{p.name}].total_bytes: {p.total_bytes}, but shape {list(p.shape)} of "
            f"{p.dtype} is {size} bytes"
        )
    if p.total_bytes > header.total_bytes:
        raise BadRequest(
            f"weights.piece[{p.name}].total_bytes: {p.total_bytes}, more than the "
            f"header's total_bytes={header.total_bytes}"
        )


def _cover(spans: list[list[int]], name: str, start: int, end: int) -> None:
    """Add [start, end) to a tensor's sorted, disjoint, merged covered spans; overlap is refused."""
    if end <= start:
        return
    i = bisect.bisect_right(spans, [start, end])
    if (i > 0 and spans[i - 1][1] > start) or (i < len(spans) and spans[i][0] < end):
        raise BadRequest(
            f"weights.piece[{name}]: bytes [{start}, {end}) were already received "
            f"(every byte of a tensor must come exactly once)"
        )
    if i > 0 and spans[i - 1][1] == start:
        spans[i - 1][1] = end
        if i < len(spans) and spans[i][0] == end:
            spans[i - 1][1] = spans.pop(i)[1]
    elif i < len(spans) and spans[i][0] == end:
        spans[i][0] = start
    else:
        spans.insert(i, [start, end])


def assemble_weights(
    chunks: Iterable[pb.WeightChunk],
    specs: Mapping[str, tuple[tuple, torch.dtype]] | None = None,
    max_bytes: int | None = None,
    on_header: Callable[[pb.WeightHeader], None] | None = None,
    base: delta.Base | None = None,
) -> tuple[int, str, dict[str, torch.Tensor], int, pb.WeightHeader]:
    """Collect a push stream into (policy_version, format, state_dict, bytes, header).

    Checks every piece's xxh3_64 (or, from a writer without xxhash, every piece's crc32 and the
    footer's sha256 of them all: one kind per push); names/shapes/dtypes against `specs` (the
    model's state dict) and each declared size against them before allocating anything; that
    every byte of every tensor arrives exactly once (overlaps and holes are refused) and all
    pieces of a tensor agree; that format "full" covers every tensor of `specs` ("partial" may
    cover a subset); and that floating tensors are finite. `on_header(header)` runs as soon as
    the header arrives (e.g. the writer's fence), before any piece is read.

    A "delta" version is decoded against `base` (the version this server holds, `delta.Base`):
    one against another base, or without one, is refused at its header with FailedPrecondition,
    `Reason.DELTA_BASE_MISSING`. Its encoded pieces are decoded into the tensors, then checked as
    any piece: their checksums are of the decoded bytes.

    Each tensor is allocated once, when its first piece arrives, and every piece is copied
    straight into it: the pushed bytes plus a few pieces in flight is all the memory it takes.
    sha256, the finiteness checks and a delta's decoding run on a worker thread, in stream order,
    overlapping the receiving, piece checks and copies."""
    push = _Assembly(specs, max_bytes, on_header, base)
    try:
        for chunk in chunks:
            kind = chunk.WhichOneof("payload")
            if kind == "header":
                push.take_header(chunk.header)
            elif kind == "piece":
                push.take_piece(chunk.piece)
            elif kind == "footer":
                push.take_footer(chunk.footer)
            else:
                raise BadRequest("weights: an empty chunk")
    except BaseException:
        push.worker.abandon()
        raise
    push.worker.finish()
    return push.result()


class _Assembly:
    """One push being assembled (`assemble_weights`): each chunk checked and copied as it comes,
    then the whole checked at its end (`result`)."""

    def __init__(self, specs, max_bytes: int | None, on_header, base: delta.Base | None = None):
        self.specs, self.max_bytes, self.on_header, self.base = specs, max_bytes, on_header, base
        self.header: pb.WeightHeader | None = None
        self.footer: pb.WeightFooter | None = None
        self.buffers: dict[str, torch.Tensor] = {}  # destination tensors, allocated once from the checked specs
        self.views: dict[str, np.ndarray] = {}  # their raw bytes (uint8 views, no copy)
        self.meta: dict[str, tuple[str, tuple, int]] = {}
        self.spans: dict[str, list[list[int]]] = {}
        self.filled: dict[str, int] = {}
        self.sums = _Checksums()
        self.nonfinite: set[str] = set()
        self.received = self.allocated = 0
        self.wire = 0  # bytes of the pieces' data as they came (a delta's are encoded)
        self.worker = InOrder(depth=4)  # holds at most a few pieces' data

    def take_header(self, header: pb.WeightHeader) -> None:
        if self.header is not None:
            raise BadRequest("weights: a second header in one push")
        self.header = header
        check_header(header, self.specs, self.max_bytes, STREAM_FORMATS)
        if self.on_header is not None:
            self.on_header(header)
        if header.format == PushKind.DELTA:
            self._check_base(header)

    def _check_base(self, h: pb.WeightHeader) -> None:
        """A delta is against the version this server holds (its run, its epoch, its version)."""
        want, held = delta.base_key(h.run_id, h.epoch, h.base_policy_version), self.base
        if held is None or held.key != want:
            raise FailedPrecondition(
                f"weights: a delta against {want}, but this server holds "
                f"{'no delta base' if held is None else held.key} (it restarted, missed a version, or "
                f"keeps none: rpc.delta_push); the full version must be pushed",
                Reason.DELTA_BASE_MISSING,
                field="header.base_policy_version",
                metadata={"holds": held.key if held is not None else ""},
            )

    def take_piece(self, p: pb.TensorPiece) -> None:
        header = self.header
        if header is None:
            raise BadRequest("weights: a tensor piece before the header")
        if self.footer is not None:
            raise BadRequest("weights: a tensor piece after the footer")
        self.worker.check()  # a piece that failed its decoding or checks ends the push here
        if p.encoding != delta.RAW:
            self._take_encoded(p, header)
            return
        data = p.data  # read once: every read of a bytes field is a new copy
        n = len(data)
        if p.raw_bytes not in (0, n):
            raise BadRequest(f"weights.piece[{p.name}].raw_bytes: {p.raw_bytes} in a RAW piece of {n} bytes")
        self.sums.check(p, data)
        name = p.name
        self._take_meta(p, header)
        self._place(p, n)
        if n:
            self.views[name][p.offset : p.offset + n] = np.frombuffer(data, dtype=np.uint8)
        if not self.sums.xxh3:
            self.worker.submit(partial(self.sums.digest.update, data))
        self._filled(p, n, n)

    def _take_meta(self, p: pb.TensorPiece, header: pb.WeightHeader) -> None:
        """A piece's tensor: the first piece allocates it, every later one agrees with it."""
        name = p.name
        if name in self.meta:
            if self.meta[name] != (p.dtype, tuple(p.shape), p.total_bytes):
                dtype, shape, total = self.meta[name]
                raise BadRequest(
                    f"weights.piece[{name}]: dtype {p.dtype}, shape {list(p.shape)}, total_bytes "
                    f"{p.total_bytes} disagree with the tensor's earlier pieces ({dtype}, "
                    f"{list(shape)}, {total})"
                )
        else:
            self._allocate(p, header)

    def _place(self, p: pb.TensorPiece, n: int) -> None:
        """The piece's bytes [offset, offset + n): inside its tensor, and not received before."""
        if p.offset < 0 or p.offset + n > p.total_bytes:
            raise BadRequest(
                f"weights.piece[{p.name}]: bytes [{p.offset}, {p.offset + n}) outside the tensor's "
                f"{p.total_bytes} bytes"
            )
        _cover(self.spans[p.name], p.name, p.offset, p.offset + n)

    def _filled(self, p: pb.TensorPiece, n: int, wire: int) -> None:
        """n more bytes of the piece's tensor placed (`wire` of them came): a tensor complete is
        checked for finiteness meanwhile; the push's bytes are bounded."""
        name = p.name
        self.filled[name] += n
        if self.filled[name] == p.total_bytes:  # complete (coverage is exact): check it meanwhile
            self.worker.submit(partial(self._check_finite, name))
        self.received += n
        self.wire += wire
        if self.max_bytes is not None and self.received > self.max_bytes:
            raise BadRequest(f"weights: more than {self.max_bytes} bytes")

    def _take_encoded(self, p: pb.TensorPiece, header: pb.WeightHeader) -> None:
        """A delta's encoded piece: its metadata and declared range checked here, before anything
        is decoded (what it decodes to is bounded by that range: `delta.decode`); then decoded
        against the base straight into the tensor, and checksummed, on the worker."""
        name, enc = p.name, p.encoding
        where = f"weights.piece[{name}]"
        if enc != delta.XOR_PLANES_ZSTD:
            raise BadRequest(f"{where}.encoding: {enc} unknown (RAW=0, XOR_PLANES_ZSTD=1)")
        if header.format != "delta" or self.base is None:
            raise BadRequest(
                f"{where}.encoding: XOR_PLANES_ZSTD in a {header.format!r} push (only 'delta' has encoded pieces)"
            )
        self.sums.kind(p)
        self._take_meta(p, header)
        n = int(p.raw_bytes)
        if n <= 0:
            raise BadRequest(f"{where}.raw_bytes: {n}, expected the piece's decoded length (at least 1)")
        self._place(p, n)
        old = self.base.tensors.get(name)
        if old is None or old.dtype != DTYPES[p.dtype] or tuple(old.shape) != tuple(p.shape):
            raise BadRequest(f"{where}: the delta base has no tensor {name!r} of this shape and dtype")
        off, itemsize = int(p.offset), DTYPES[p.dtype].itemsize
        out = self.views[name][off : off + n]
        data = p.data
        self.worker.submit(partial(self._decode, p, data, n, itemsize, raw_view(old)[off : off + n], out, where))
        self._filled(p, n, len(data))

    def _decode(self, p, data, n: int, itemsize: int, old: np.ndarray, out: np.ndarray, where: str) -> None:
        delta.decode(data, n, itemsize, int(p.offset), old, out, where)
        self.sums.verify(p, out)
        if not self.sums.xxh3:
            self.sums.digest.update(out.data)

    def _allocate(self, p: pb.TensorPiece, header: pb.WeightHeader) -> None:
        """A tensor's first piece: its declared name, shape, dtype and size checked, then its
        destination allocated once."""
        _check_piece(p, self.specs, header, self.max_bytes)
        if len(self.buffers) >= header.num_tensors:
            raise BadRequest(f"weights: more than the {header.num_tensors} tensors the header announced")
        self.allocated += p.total_bytes
        if self.allocated > header.total_bytes:
            raise BadRequest(
                f"weights: the tensors' sizes add up to more than the header's total_bytes={header.total_bytes}"
            )
        t = torch.empty([int(d) for d in p.shape], dtype=DTYPES[p.dtype])
        self.buffers[p.name] = t
        self.views[p.name] = raw_view(t)
        self.meta[p.name] = (p.dtype, tuple(p.shape), p.total_bytes)
        self.spans[p.name] = []
        self.filled[p.name] = 0

    def _check_finite(self, name: str) -> None:
        t = self.buffers[name]
        if t.is_floating_point() and not all_finite(t):
            self.nonfinite.add(name)

    def take_footer(self, footer: pb.WeightFooter) -> None:
        if self.footer is not None:
            raise BadRequest("weights: a second footer in one push")
        self.footer = footer

    def result(self) -> tuple[int, str, dict[str, torch.Tensor], int, pb.WeightHeader]:
        """The whole push checked (its checksum, its tensors' count, coverage, bytes and values)."""
        header, footer = self.header, self.footer
        if header is None or footer is None:
            raise BadRequest("weights: the push ended without " + ("a header" if header is None else "a footer"))
        self.sums.check_footer(footer)
        if len(self.buffers) != header.num_tensors:
            raise BadRequest(f"weights: {len(self.buffers)} tensors received, header announced {header.num_tensors}")
        if self.specs is not None:
            check_coverage(self.buffers, self.specs, header.format, "weights", what="push")
        for name in self.buffers:
            self._check_complete(name)
        if self.allocated != header.total_bytes:
            raise BadRequest(
                f"weights: {self.allocated} bytes of tensors received, "
                f"header announced total_bytes={header.total_bytes}"
            )
        for name in self.buffers:  # every tensor is complete here, so each was checked
            if name in self.nonfinite:
                raise BadRequest(f"weights.piece[{name}]: contains NaN or infinity")
        return int(header.policy_version), header.format, self.buffers, self.received, header

    def _check_complete(self, name: str) -> None:
        """Every byte of the tensor came (pieces never overlap, so a count short means a hole)."""
        size = self.meta[name][2]
        if self.filled[name] != size:
            s = self.spans[name]
            if not s:
                hole = (0, size)
            else:
                hole = (0, s[0][0]) if s[0][0] > 0 else (s[0][1], s[1][0] if len(s) > 1 else size)
            raise BadRequest(
                f"weights.piece[{name}]: {self.filled[name]} of {size} bytes received; "
                f"bytes [{hole[0]}, {hole[1]}) missing"
            )


class _Checksums:
    """One push's checksums: xxh3_64 on every piece, or on none (then crc32 on every piece and the
    footer's sha256 of all their data, in stream order), as its first piece decides."""

    def __init__(self):
        self.digest = hashlib.sha256()
        self.xxh3: bool | None = None  # whether this push's pieces carry xxh3 (decided by its first piece)

    def check(self, p: pb.TensorPiece, data) -> None:
        """The piece's xxh3_64, or its crc32 (one kind per push, decided by its first piece)."""
        self.kind(p)
        self.verify(p, data)

    def kind(self, p: pb.TensorPiece) -> None:
        """xxh3 on every piece of a push, or on none (then crc32 and the footer's sha256)."""
        has_xxh3 = p.HasField("xxh3")
        if self.xxh3 is None:
            self.xxh3 = has_xxh3
            if has_xxh3 and xxhash is None:
                raise BadRequest("weights.piece.xxh3: this server cannot check xxh3_64 (install xxhash)")
        elif has_xxh3 != self.xxh3:
            raise BadRequest(f"weights.piece[{p.name}]: xxh3 on some pieces of a push and not on others")

    def verify(self, p: pb.TensorPiece, data) -> None:
        if self.xxh3:
            if xxhash.xxh3_64_intdigest(data) != p.xxh3:
                raise BadRequest(f"weights.piece[{p.name}]: xxh3 mismatch at offset {p.offset}")
        elif zlib.crc32(data) != p.crc32:
            raise BadRequest(f"weights.piece[{p.name}]: crc32 mismatch at offset {p.offset}")

    def check_footer(self, footer: pb.WeightFooter) -> None:
        """The footer's sha256: of every piece's data when the pieces carry no xxh3, else none."""
        if self.xxh3:
            if footer.sha256:
                raise BadRequest("weights.footer.sha256: set in a push whose pieces carry xxh3")
        elif footer.sha256 != self.digest.hexdigest() and not (self.xxh3 is None and not footer.sha256):
            # (xxh3 None: no piece came)
            raise BadRequest("weights.footer.sha256: checksum mismatch; the push is incomplete or corrupt")
