"""Weights over gRPC, both ends: a state dict encoded once as a push stream of serialised
`WeightChunk` messages (`encode_weights`: header with the writer's fence, checksummed pieces,
footer), fanned out to many servers (`Fanout`); and on the server, the pieces decoded without a
copy (`WeightChunkDecoder`) and collected into a checked state dict (`assemble_weights`)."""

from __future__ import annotations

import bisect
import hashlib
import queue
import threading
import zlib
from functools import partial
from typing import Callable, Iterable, Iterator, Mapping

import numpy as np
import torch

from ..common.rpc.codec import DTYPE_NAMES, DTYPES, checked_shape
from ..common.rpc.errors import BadRequest
from ..common.rpc.gen import common_pb2 as pb
from .check import all_finite, check_coverage, check_header, check_tensor
from .protocol import CHUNK_BYTES, raw_view, xxhash


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


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


_PIECE_TAG, _DATA_TAG = b"\x12", b"\x32"  # WeightChunk.piece (field 2), TensorPiece.data (field 6): length-delimited


class _InOrder:
    """A background thread running submitted jobs in order; at most `depth` wait at once (the
    submitter blocks beyond that, which bounds the bytes they hold). hashlib, zlib and torch
    release the GIL on large buffers, so the jobs overlap the submitter's own work."""

    def __init__(self, depth: int = 4):
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="weights-worker", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            if self._error is None:
                try:
                    job()
                except BaseException as e:  # reported by finish()
                    self._error = e

    def submit(self, job: Callable[[], None]) -> None:
        self._q.put(job)

    def finish(self) -> None:
        """Wait for every job; raise the first one's exception."""
        self._q.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error

    def abandon(self) -> None:
        """Stop after the queued jobs, without waiting (the stream failed)."""
        self._q.put(None)


def encode_weights(
    state_dict: Mapping[str, torch.Tensor],
    policy_version: int,
    chunk_bytes: int = CHUNK_BYTES,
    fmt: str = "full",
    run_id: str = "",
    epoch: int = 0,
) -> Iterator[bytes]:
    """A state dict as a push stream of serialised `WeightChunk` messages: header (with the
    writer's run id and epoch, the fencing token), pieces of at most `chunk_bytes`, each with the
    xxh3_64 of its data (~30 GB/s; with the receiver's exact coverage of every tensor, the whole
    stream is checked), then the footer. Without the xxhash package: crc32 per piece and the
    footer's sha256 of every piece's data in stream order.

    Serialised once, the stream can go to any number of servers unchanged (`Fanout`). Each piece
    is the protobuf encoding of its metadata followed by the data field, written straight from the
    tensor's memory: one copy per byte (into the message), no intermediate `bytes` of the tensor."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes: {chunk_bytes}, expected at least 1")
    tensors = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
    for t in tensors.values():
        if t.dtype not in DTYPE_NAMES:
            raise TypeError(f"dtype {t.dtype} cannot go on the wire")
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    yield pb.WeightChunk(
        header=pb.WeightHeader(
            policy_version=policy_version,
            format=fmt,
            num_tensors=len(tensors),
            total_bytes=total,
            run_id=run_id,
            epoch=epoch,
        )
    ).SerializeToString()
    digest = hashlib.sha256()
    hasher = _InOrder(depth=64)  # holds views of `tensors`, no bytes
    try:
        for name, t in tensors.items():
            raw = raw_view(t)
            size = len(raw)
            for off in range(0, max(size, 1), chunk_bytes):
                data = memoryview(raw[off : off + chunk_bytes])  # type: ignore[arg-type]  # an ndarray is a buffer
                check: dict[str, int]
                if xxhash is not None:
                    check = {"xxh3": xxhash.xxh3_64_intdigest(data)}
                else:
                    hasher.submit(partial(digest.update, data))
                    check = {"crc32": zlib.crc32(data)}
                shape = list(t.shape)
                meta = pb.TensorPiece(
                    name=name,
                    dtype=DTYPE_NAMES[t.dtype],
                    shape=shape,
                    offset=off,
                    total_bytes=size,
                    **check,  # type: ignore[arg-type]
                ).SerializeToString()
                n = len(data)
                field = _DATA_TAG + _varint(n) if n else b""
                yield b"".join((_PIECE_TAG, _varint(len(meta) + len(field) + n), meta, field, data))
    except BaseException:
        hasher.abandon()
        raise
    hasher.finish()
    footer = pb.WeightFooter(sha256="" if xxhash is not None else digest.hexdigest())
    yield pb.WeightChunk(footer=footer).SerializeToString()


def weight_chunks(
    state_dict: Mapping[str, torch.Tensor],
    policy_version: int,
    chunk_bytes: int = CHUNK_BYTES,
    fmt: str = "full",
    run_id: str = "",
    epoch: int = 0,
) -> Iterator[pb.WeightChunk]:
    """`encode_weights` as `WeightChunk` messages (for a servicer's response stream and tests)."""
    for raw in encode_weights(state_dict, policy_version, chunk_bytes, fmt, run_id, epoch):
        yield pb.WeightChunk.FromString(raw)


class Fanout:
    """One serialised push stream read by `readers` consumers (one per server) at their own pace,
    encoded once by a background thread. At most `window` chunks are held: the encoder waits
    while the slowest live reader is `window` chunks behind. A reader that stops (its RPC ended
    or failed) must `detach` so that it no longer holds the others back."""

    def __init__(self, chunks: Iterable[bytes], readers: int, window: int = 4):
        self._src = iter(chunks)
        self._window = max(1, window)
        self._buf: dict[int, bytes] = {}
        self._pos = [0] * readers
        self._live = [True] * readers
        self._produced = 0
        self._done = False
        self._error: BaseException | None = None
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._produce, name="weights-encoder", daemon=True)
        self._thread.start()

    def _low(self) -> int:
        live = [p for p, ok in zip(self._pos, self._live) if ok]
        return min(live) if live else self._produced

    def _produce(self) -> None:
        try:
            while True:
                with self._cv:
                    while self._produced - self._low() >= self._window:
                        self._cv.wait()
                    if not any(self._live):
                        break
                try:
                    chunk = next(self._src)
                except StopIteration:
                    break
                with self._cv:
                    self._buf[self._produced] = chunk
                    self._produced += 1
                    self._cv.notify_all()
        except BaseException as e:  # the readers raise it
            with self._cv:
                self._error = e
        finally:
            close = getattr(self._src, "close", None)
            if close is not None:
                close()  # an encoder nobody reads any more stops (and its hashing thread with it)
            with self._cv:
                self._done = True
                self._cv.notify_all()

    def reader(self, i: int) -> Iterator[bytes]:
        try:
            while True:
                with self._cv:
                    while self._pos[i] >= self._produced and not self._done:
                        self._cv.wait()
                    if self._pos[i] >= self._produced:
                        if self._error is not None:
                            raise self._error
                        return
                    chunk = self._buf[self._pos[i]]
                    self._pos[i] += 1
                    low = self._low()
                    for k in [k for k in self._buf if k < low]:
                        del self._buf[k]
                    self._cv.notify_all()
                yield chunk
        finally:
            self.detach(i)

    def detach(self, i: int) -> None:
        with self._cv:
            if self._live[i]:
                self._live[i] = False
                low = self._low()
                for k in [k for k in self._buf if k < low]:
                    del self._buf[k]
                self._cv.notify_all()

    def join(self) -> None:
        self._thread.join()


class _PieceView:
    """A `WeightChunk` holding a piece, decoded without copying its data: the metadata is a
    `TensorPiece` (parsed by protobuf from the message without its data field) and `piece.data`
    a memoryview of the received message's bytes."""

    __slots__ = ("piece",)

    def __init__(self, piece):
        self.piece = piece

    @staticmethod
    def WhichOneof(group: str) -> str:  # the protobuf name
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

    def FromString(self, raw: bytes):  # as protobuf's
        try:
            view = self._fast(raw)
        except Exception:  # whatever is wrong, protobuf says it in its own words below
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
        meta = pb.TensorPiece.FromString(bytes(mv[start : data[0]]) + bytes(mv[data[2] : end]))
        return _PieceView(_PieceMeta(meta, mv[data[1] : data[2]]))


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
) -> tuple[int, str, dict[str, torch.Tensor], int, pb.WeightHeader]:
    """Collect a push stream into (policy_version, format, state_dict, bytes, header).

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
    push = _Assembly(specs, max_bytes, on_header)
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

    def __init__(self, specs, max_bytes: int | None, on_header):
        self.specs, self.max_bytes, self.on_header = specs, max_bytes, on_header
        self.header: pb.WeightHeader | None = None
        self.footer: pb.WeightFooter | None = None
        self.buffers: dict[str, torch.Tensor] = {}  # destination tensors, allocated once from the checked specs
        self.views: dict[str, np.ndarray] = {}  # their raw bytes (uint8 views, no copy)
        self.meta: dict[str, tuple[str, tuple, int]] = {}
        self.spans: dict[str, list[list[int]]] = {}
        self.filled: dict[str, int] = {}
        self.digest = hashlib.sha256()
        self.nonfinite: set[str] = set()
        self.received = self.allocated = 0
        self.xxh3: bool | None = None  # whether this push's pieces carry xxh3 (decided by its first piece)
        self.worker = _InOrder(depth=4)  # holds at most a few pieces' data

    def take_header(self, header: pb.WeightHeader) -> None:
        if self.header is not None:
            raise BadRequest("weights: a second header in one push")
        self.header = header
        check_header(header, self.specs, self.max_bytes)
        if self.on_header is not None:
            self.on_header(header)

    def take_piece(self, p: pb.TensorPiece) -> None:
        header = self.header
        if header is None:
            raise BadRequest("weights: a tensor piece before the header")
        if self.footer is not None:
            raise BadRequest("weights: a tensor piece after the footer")
        data = p.data  # read once: every read of a bytes field is a new copy
        n = len(data)
        self._check_sum(p, data)
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
        if p.offset < 0 or p.offset + n > p.total_bytes:
            raise BadRequest(
                f"weights.piece[{name}]: bytes [{p.offset}, {p.offset + n}) outside the tensor's {p.total_bytes} bytes"
            )
        _cover(self.spans[name], name, p.offset, p.offset + n)
        if n:
            self.views[name][p.offset : p.offset + n] = np.frombuffer(data, dtype=np.uint8)
        self.filled[name] += n
        if not self.xxh3:
            self.worker.submit(partial(self.digest.update, data))
        if self.filled[name] == p.total_bytes:  # complete (coverage is exact): check it meanwhile
            self.worker.submit(partial(self._check_finite, name))
        self.received += n
        if self.max_bytes is not None and self.received > self.max_bytes:
            raise BadRequest(f"weights: more than {self.max_bytes} bytes")

    def _check_sum(self, p: pb.TensorPiece, data: bytes) -> None:
        """The piece's xxh3_64, or its crc32 (one kind per push, decided by its first piece)."""
        has_xxh3 = p.HasField("xxh3")
        if self.xxh3 is None:
            self.xxh3 = has_xxh3
            if has_xxh3 and xxhash is None:
                raise BadRequest("weights.piece.xxh3: this server cannot check xxh3_64 (install xxhash)")
        elif has_xxh3 != self.xxh3:
            raise BadRequest(f"weights.piece[{p.name}]: xxh3 on some pieces of a push and not on others")
        if self.xxh3:
            if xxhash.xxh3_64_intdigest(data) != p.xxh3:
                raise BadRequest(f"weights.piece[{p.name}]: xxh3 mismatch at offset {p.offset}")
        elif zlib.crc32(data) != p.crc32:
            raise BadRequest(f"weights.piece[{p.name}]: crc32 mismatch at offset {p.offset}")

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
        if self.xxh3:
            if footer.sha256:
                raise BadRequest("weights.footer.sha256: set in a push whose pieces carry xxh3")
        elif footer.sha256 != self.digest.hexdigest() and not (self.xxh3 is None and not footer.sha256):
            # (xxh3 None: no piece came)
            raise BadRequest("weights.footer.sha256: checksum mismatch; the push is incomplete or corrupt")
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
