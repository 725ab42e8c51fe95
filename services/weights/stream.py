"""Weights over gRPC, the sender's end: a state dict encoded once as a push stream of serialised
`WeightChunk` messages (`encode_weights`, what `StreamSpec` says: header with the writer's fence,
checksummed pieces, footer; a DELTA's pieces encoded against its base), and fanned out to many
servers (`Fanout`). The receiver's end is assemble.py."""

from __future__ import annotations

import collections
import hashlib
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Generator, Iterable, Iterator, Mapping

import numpy as np
import torch

from ..common.rpc.codec import DTYPE_NAMES
from ..common.rpc.gen import common_pb2 as pb
from . import delta
from .protocol import CHUNK_BYTES, InOrder, PushKind, raw_view, threads, xxhash


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_PIECE_TAG, _DATA_TAG = b"\x12", b"\x32"  # WeightChunk.piece (field 2), TensorPiece.data (field 6): length-delimited


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
    yield _header(tensors, spec)
    digest = hashlib.sha256()
    hasher = InOrder(depth=64)  # holds views of `tensors`, no bytes
    spans = _spans(tensors, chunk_bytes)
    pieces = _raw_pieces(spans) if olds is None else _delta_pieces(spans, olds)
    try:
        for (name, t, off, size, new), (data, check, encoding) in pieces:
            if xxhash is None:
                hasher.submit(partial(digest.update, new))  # the new bytes, whatever the encoding
            yield _piece(name, t, off, size, new, data, check, encoding)
    except BaseException:
        hasher.abandon()
        raise
    finally:
        pieces.close()  # (a delta's encoding threads stop)
    hasher.finish()
    footer = pb.WeightFooter(sha256="" if xxhash is not None else digest.hexdigest())
    yield pb.WeightChunk(footer=footer).SerializeToString()


def _header(tensors: Mapping[str, torch.Tensor], spec: StreamSpec) -> bytes:
    """The serialised header: the version, its format, the tensors' count and bytes, the writer's
    fence and, for a DELTA, the version it is against."""
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    return pb.WeightChunk(
        header=pb.WeightHeader(
            policy_version=spec.policy_version,
            format=str(spec.kind),
            num_tensors=len(tensors),
            total_bytes=total,
            run_id=spec.run_id,
            epoch=spec.epoch,
            base_policy_version=spec.base_version if spec.base is not None else 0,
        )
    ).SerializeToString()


def _piece(name: str, t: torch.Tensor, off: int, size: int, new, data, check: dict, encoding) -> bytes:
    """One serialised piece: its metadata's protobuf encoding, then the data field written
    straight from `data` (the tensor's memory, or its encoded delta)."""
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
    return b"".join((_PIECE_TAG, _varint(len(meta) + len(field) + n), meta, field, data))


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
