"""Weights on the wire, the sending side: a state dict encoded once as a push stream of
serialised `WeightChunk` messages (`encode_weights`), fanned out to many servers (`Fanout`), and
the checks a received version must pass on either path (gRPC stream or shared memory)."""
from __future__ import annotations

import hashlib
import math
import queue
import threading
import zlib
from typing import Callable, Iterable, Iterator, Mapping

import numpy as np
import torch

from .codec import DTYPE_NAMES

try:
    import xxhash
except ImportError:  # crc32 per piece and sha256 of the stream then (slower, as safe against corruption)
    xxhash = None
from .errors import BadRequest
from .gen import common_pb2 as pb

WEIGHT_FORMATS = ("full", "partial")


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _raw_view(t: torch.Tensor) -> np.ndarray:
    """The raw little-endian bytes of a contiguous CPU tensor as a flat uint8 array, no copy."""
    return t.reshape(-1).view(torch.uint8).numpy()


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


def encode_weights(state_dict: Mapping[str, torch.Tensor], version: int, chunk_bytes: int = 16 << 20,
                   fmt: str = "full", run_id: str = "", epoch: int = 0) -> Iterator[bytes]:
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
    yield pb.WeightChunk(header=pb.WeightHeader(version=version, format=fmt, num_tensors=len(tensors),
                                                total_bytes=total, run_id=run_id, epoch=epoch)).SerializeToString()
    digest = hashlib.sha256()
    hasher = _InOrder(depth=64)  # holds views of `tensors`, no bytes
    try:
        for name, t in tensors.items():
            raw = _raw_view(t)
            size = len(raw)
            for off in range(0, max(size, 1), chunk_bytes):
                data = memoryview(raw[off:off + chunk_bytes])
                if xxhash is not None:
                    check = {"xxh3": xxhash.xxh3_64_intdigest(data)}
                else:
                    hasher.submit(lambda d=data: digest.update(d))
                    check = {"crc32": zlib.crc32(data)}
                meta = pb.TensorPiece(name=name, dtype=DTYPE_NAMES[t.dtype], shape=list(t.shape), offset=off,
                                      total_bytes=size, **check).SerializeToString()
                n = len(data)
                field = _DATA_TAG + _varint(n) if n else b""
                yield b"".join((_PIECE_TAG, _varint(len(meta) + len(field) + n), meta, field, data))
    except BaseException:
        hasher.abandon()
        raise
    hasher.finish()
    footer = pb.WeightFooter(sha256="" if xxhash is not None else digest.hexdigest())
    yield pb.WeightChunk(footer=footer).SerializeToString()


def weight_chunks(state_dict: Mapping[str, torch.Tensor], version: int, chunk_bytes: int = 4 << 20,
                  fmt: str = "full", run_id: str = "", epoch: int = 0) -> Iterator[pb.WeightChunk]:
    """`encode_weights` as `WeightChunk` messages (for a servicer's response stream and tests)."""
    for raw in encode_weights(state_dict, version, chunk_bytes, fmt, run_id, epoch):
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


def _all_finite(t: torch.Tensor) -> bool:
    """No NaN or infinity in a floating tensor: min and max are finite (both propagate NaN). A
    reduction, ~10x faster than `isfinite(t).all()` and without its tensor-sized temporary."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return True
    lo, hi = torch.aminmax(flat)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))
