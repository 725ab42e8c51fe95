"""Weights over gRPC, both ends: a state dict encoded once as a push stream of serialised
`WeightChunk` messages (`encode_weights`: header with the writer's fence, checksummed pieces,
footer), fanned out to many servers (`Fanout`); and on the server, the pieces decoded without a
copy (`WeightChunkDecoder`) and collected into a checked state dict (`assemble_weights`)."""

from __future__ import annotations

import bisect
import collections
import hashlib
import queue
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Callable, Generator, Iterable, Iterator, Mapping

import numpy as np
import torch

from ..common.rpc.codec import DTYPE_NAMES, DTYPES, checked_shape
from ..common.rpc.errors import BadRequest, FailedPrecondition, Reason
from ..common.rpc.gen import common_pb2 as pb
from . import delta
from .check import all_finite, check_coverage, check_header, check_tensor
from .protocol import CHUNK_BYTES, STREAM_FORMATS, PushKind, raw_view, threads, xxhash


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

    def check(self) -> None:
        """Raise a failed job's exception now (the stream need not be read to its end)."""
        if self._error is not None:
            raise self._error

    def finish(self) -> None:
        """Wait for every job; raise the first one's exception."""
        self._q.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error

    def abandon(self) -> None:
        """Stop after the queued jobs, without waiting (the stream failed)."""
        self._q.put(None)


@dataclass(frozen=True)
class StreamSpec:
    """What a push stream is of, one bundle for the encoder and the chunker: `policy_version`, in
    pieces of at most `chunk_bytes`, its `kind`, the writer's fence (`run_id`, `epoch`) and, for a
    DELTA, the `base` state it is changes to and that state's `base_version`."""

    policy_version: int
    chunk_bytes: int = CHUNK_BYTES
    kind: PushKind = PushKind.FULL
    run_id: str = ""
    epoch: int = 0
    base: Mapping[str, torch.Tensor] | None = None
    base_version: int = 0


def encode_weights(state_dict: Mapping[str, torch.Tensor], spec: StreamSpec) -> Iterator[bytes]:
    """A state dict as a push stream of serialised `WeightChunk` messages: header (with the
    writer's run id and epoch, the fencing token), pieces of at most `chunk_bytes`, each with the
    xxh3_64 of its data (~30 GB/s; with the receiver's exact coverage of every tensor, the whole
    stream is checked), then the footer. Without the xxhash package: crc32 per piece and the
    footer's sha256 of every piece's data in stream order.

    Serialised once, the stream can go to any number of servers unchanged (`Fanout`). Each piece
    is the protobuf encoding of its metadata followed by the data field, written straight from the
    tensor's memory: one copy per byte (into the message), no intermediate `bytes` of the tensor.

    A DELTA (`spec.base` given): every tensor as what changed since `base`, the state of version
    `base_version` (same names, shapes and dtypes), each piece encoded by `delta.encode` on a few
    threads (zstd releases the GIL), or RAW where that would not be smaller. Pieces cover the same
    raw byte ranges and carry the same checksums (of the new bytes) as the full stream's."""
    chunk_bytes, base = spec.chunk_bytes, spec.base
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes: {chunk_bytes}, expected at least 1")
    if (spec.kind == PushKind.DELTA) != (base is not None):
        raise ValueError(
            f"format {spec.kind!r} {'with' if base is not None else 'without'} a base (only 'delta' has one)"
        )
    tensors = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
    for t in tensors.values():
        if t.dtype not in DTYPE_NAMES:
            raise TypeError(f"dtype {t.dtype} cannot go on the wire")
    olds = None if base is None else _base_views(tensors, base)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    yield pb.WeightChunk(
        header=pb.WeightHeader(
            policy_version=spec.policy_version,
            format=str(spec.kind),
            num_tensors=len(tensors),
            total_bytes=total,
            run_id=spec.run_id,
            epoch=spec.epoch,
            base_policy_version=spec.base_version if base is not None else 0,
        )
    ).SerializeToString()
    digest = hashlib.sha256()
    hasher = _InOrder(depth=64)  # holds views of `tensors`, no bytes
    spans = _spans(tensors, chunk_bytes)
    pieces = _raw_pieces(spans) if olds is None else _delta_pieces(spans, olds)
    try:
        for (name, t, off, size, new), (data, check, encoding) in pieces:
            if xxhash is None:
                hasher.submit(partial(digest.update, new))  # the new bytes, whatever the encoding
            meta = pb.TensorPiece(
                name=name,
                dtype=DTYPE_NAMES[t.dtype],
                shape=list(t.shape),
                offset=off,
                total_bytes=size,
                encoding=encoding,
                raw_bytes=len(new) if encoding != delta.RAW else 0,
                **check,  # type: ignore[arg-type]
            ).SerializeToString()
            n = len(data)
            field = _DATA_TAG + _varint(n) if n else b""
            yield b"".join((_PIECE_TAG, _varint(len(meta) + len(field) + n), meta, field, data))
    except BaseException:
        hasher.abandon()
        raise
    finally:
        pieces.close()  # (a delta's encoding threads stop)
    hasher.finish()
    footer = pb.WeightFooter(sha256="" if xxhash is not None else digest.hexdigest())
    yield pb.WeightChunk(footer=footer).SerializeToString()


Span = tuple  # (name, tensor, offset, tensor bytes, the new bytes [offset, offset + chunk) as a memoryview)


def _spans(tensors: Mapping[str, torch.Tensor], chunk_bytes: int) -> Iterator[Span]:
    for name, t in tensors.items():
        raw = raw_view(t)
        size = len(raw)
        for off in range(0, max(size, 1), chunk_bytes):
            yield name, t, off, size, memoryview(raw[off : off + chunk_bytes])  # type: ignore[arg-type]  # an ndarray is a buffer


def _check_of(data) -> dict[str, int]:
    return {"xxh3": xxhash.xxh3_64_intdigest(data)} if xxhash is not None else {"crc32": zlib.crc32(data)}


def _raw_pieces(spans: Iterator[Span]) -> Generator[tuple[Span, tuple], None, None]:
    for span in spans:
        new = span[4]
        yield span, (new, _check_of(new), delta.RAW)


def _base_views(tensors: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """The base's raw bytes per tensor, each checked to be the new tensor's shape and dtype."""
    out = {}
    for name, t in tensors.items():
        b = base.get(name)
        if b is None or b.shape != t.shape or b.dtype != t.dtype:
            raise ValueError(f"delta: the base has no tensor {name!r} of shape {list(t.shape)} and dtype {t.dtype}")
        out[name] = raw_view(b.detach().cpu().contiguous())
    return out


def _delta_pieces(spans: Iterator[Span], olds: Mapping[str, np.ndarray]) -> Generator[tuple[Span, tuple], None, None]:
    """Each span's (data, checksum, encoding), encoded against `olds` on a pool of threads, in
    stream order, at most a few pieces ahead of the reader."""

    def one(span: Span) -> tuple:
        name, t, off, _, new = span
        arr = np.frombuffer(new, dtype=np.uint8)
        data = delta.encode(arr, olds[name][off : off + len(arr)], t.element_size(), off) if len(arr) else None
        return (new, _check_of(new), delta.RAW) if data is None else (data, _check_of(new), delta.XOR_PLANES_ZSTD)

    workers = threads()
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="weights-delta")
    ahead: collections.deque = collections.deque()
    try:
        for span in spans:
            ahead.append((span, pool.submit(one, span)))
            if len(ahead) > 2 * workers:
                span0, f = ahead.popleft()
                yield span0, f.result()
        while ahead:
            span0, f = ahead.popleft()
            yield span0, f.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def weight_chunks(state_dict: Mapping[str, torch.Tensor], spec: StreamSpec) -> Iterator[pb.WeightChunk]:
    """`encode_weights` as `WeightChunk` messages (for a servicer's response stream and tests)."""
    for raw in encode_weights(state_dict, spec):
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
        self.digest = hashlib.sha256()
        self.nonfinite: set[str] = set()
        self.received = self.allocated = 0
        self.wire = 0  # bytes of the pieces' data as they came (a delta's are encoded)
        self.xxh3: bool | None = None  # whether this push's pieces carry xxh3 (decided by its first piece)
        self.worker = _InOrder(depth=4)  # holds at most a few pieces' data

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
        self._check_sum(p, data)
        name = p.name
        self._take_meta(p, header)
        self._place(p, n)
        if n:
            self.views[name][p.offset : p.offset + n] = np.frombuffer(data, dtype=np.uint8)
        if not self.xxh3:
            self.worker.submit(partial(self.digest.update, data))
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
        self._sum_kind(p)
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
        self._verify_sum(p, out)
        if not self.xxh3:
            self.digest.update(out.data)

    def _check_sum(self, p: pb.TensorPiece, data) -> None:
        """The piece's xxh3_64, or its crc32 (one kind per push, decided by its first piece)."""
        self._sum_kind(p)
        self._verify_sum(p, data)

    def _sum_kind(self, p: pb.TensorPiece) -> None:
        """xxh3 on every piece of a push, or on none (then crc32 and the footer's sha256)."""
        has_xxh3 = p.HasField("xxh3")
        if self.xxh3 is None:
            self.xxh3 = has_xxh3
            if has_xxh3 and xxhash is None:
                raise BadRequest("weights.piece.xxh3: this server cannot check xxh3_64 (install xxhash)")
        elif has_xxh3 != self.xxh3:
            raise BadRequest(f"weights.piece[{p.name}]: xxh3 on some pieces of a push and not on others")

    def _verify_sum(self, p: pb.TensorPiece, data) -> None:
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
