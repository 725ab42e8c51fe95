"""What both ends of every transport agree on: the formats, the one chunk size, the dtype tables
(the wire's are `common.rpc.codec.DTYPES`; safetensors' for shared memory here), the checksums
(xxh3_64, crc32 where the xxhash package is missing), the raw bytes of a tensor, and the names of
the shared-memory files."""

from __future__ import annotations

import enum
import os
import queue
import re
import threading
import zlib
from typing import Callable

import numpy as np
import torch

from ..common.rpc.errors import BadRequest

try:
    import xxhash
except ImportError:  # crc32 per piece (and the stream's sha256): slower, the same guarantees against corruption
    xxhash = None  # type: ignore[assignment]


class PushKind(str, enum.Enum):
    """What a version's push carries (`WeightHeader.format` on the wire, `rlhf.format` in a
    shared file). A member is its string wherever one is used: compared, hashed, formatted."""

    FULL = "full"  # every tensor of the model
    PARTIAL = "partial"  # a subset (LoRA's merged target modules) over the base the server holds
    DELTA = "delta"  # every tensor, as what changed since a base version the server holds (delta.py)

    __str__ = str.__str__
    __format__ = str.__format__  # type: ignore[assignment]  # its value in f-strings, on 3.10 to 3.13 alike
    __hash__ = str.__hash__


WEIGHT_FORMATS = (PushKind.FULL, PushKind.PARTIAL)  # what any transport carries
STREAM_FORMATS = (*WEIGHT_FORMATS, PushKind.DELTA)  # the stream also: every tensor, as changes to a base
COMPLETE_FORMATS = (PushKind.FULL, PushKind.DELTA)  # versions with every tensor of the model
CHUNK_BYTES = 16 << 20  # a stream's piece and a shared file's checksummed piece; well under rpc.max_message_mb


def chunk_bytes(max_message_mb: int) -> int:
    """The piece size of a push stream under `rpc.max_message_mb` (half a message: room for metadata)."""
    return min(CHUNK_BYTES, max_message_mb << 19)


def raw_view(t: torch.Tensor) -> np.ndarray:
    """The raw little-endian bytes of a contiguous CPU tensor as a flat uint8 array, no copy."""
    return t.reshape(-1).view(torch.uint8).numpy()


def nbytes(state) -> int:
    """The bytes of a state dict's tensors."""
    return sum(t.numel() * t.element_size() for t in state.values())


# ------------------------------------------------------------------ checksums
def default_digest() -> str:
    return "xxh3_64" if xxhash is not None else "crc32"


class Crc32:
    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def intdigest(self) -> int:
        return self.value


def hasher(kind: str):
    """A running checksum of kind "xxh3_64" or "crc32" (`update`, `intdigest`)."""
    if kind == "xxh3_64" and xxhash is not None:
        return xxhash.xxh3_64()
    if kind == "crc32":
        return Crc32()
    raise BadRequest(
        f"shm.digest: {kind!r} is not available here (xxh3_64 needs the xxhash package; crc32 always works)"
    )


# ------------------------------------------------------------------ shared-memory files (safetensors layout)
PROBE_PREFIX, FILE_PREFIX = "rlhf-probe-", "rlhf-weights-"
STEP = 2 << 20  # a piece is checked in steps this size: its checksum and finiteness read it from cache
MIN_PIECE, MAX_PIECE = 1 << 16, 1 << 30
MAX_HEADER = 100 << 20  # safetensors' own limit
ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}


def threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def safe_run_id(run_id: str) -> str:
    return re.sub(r"[^0-9A-Za-z_.]", "_", run_id)[:64] or "_"


def weights_file_name(run_id: str, epoch: int, policy_version: int, fmt: str) -> str:
    return f"{FILE_PREFIX}{safe_run_id(run_id)}-e{int(epoch)}-v{int(policy_version)}-{fmt}.safetensors"


class InOrder:
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
