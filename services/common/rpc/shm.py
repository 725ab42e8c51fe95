"""Weights through shared memory (the format, the learner's writer, the co-location check; the
server's side is `shm_read.py`): the fast path from the learner to the generation servers on its
host, beside the gRPC stream (`weights.py`), which stays the path to every other server.

Both sides name a directory on a tmpfs they share (`rpc.shm_dir`: a compose tmpfs volume, a pod's
emptyDir with medium Memory, a directory in /dev/shm).

Co-location is proven, not assumed: a generation server writes a probe file whose name carries a
random nonce (`Probe`) and advertises the nonce in its registry entry; the learner counts a server
as co-located only if that file is in its own directory (`colocated`), i.e. the same volume.

A version is written once for all co-located servers (`SharedWeightsWriter.write`), in the
safetensors layout (8-byte header length, JSON header, tensors back to back; tensors ordered by
element size, so every one is aligned for its dtype) with the version, run id, epoch and format in
its metadata. It is written under a temporary name and renamed into place when complete, so a
name only ever holds a whole file. The learner then sends each server a `SharedWeights` request
(authenticated gRPC, like a push) with the file's name and size, the push's header (its fence)
and a checksum of every piece of the file (xxh3_64, ~30 GB/s; crc32 where xxhash is missing).

A server maps the file (no copy; `open_shared_weights`) and checks the fence, name, size, header
structure (offsets cover the data exactly once), names/shapes/dtypes against its model and the
request's header, every piece's checksum, and finiteness, before anything is loaded.

Pages are recycled: writing a new version, the learner renames its previous file (every server has
loaded that one or given up) to the temporary name and writes over it, since fresh tmpfs pages
cost more than the copy. Locks keep this safe: the writer holds an exclusive flock while it
writes; a reader holds a shared one from before its checks to the end of its swap; a file some
reader still holds is not recycled (it is unlinked, the reader keeps its mapping) and a reader
that finds a file locked refuses it. At most one file per format ("full", "partial") is kept.
"""
from __future__ import annotations

import bisect
import contextlib
import fcntl
import json
import math
import mmap
import os
import re
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Mapping

import numpy as np
import torch

from .errors import BadRequest
from .gen import common_pb2 as pb, generation_pb2 as gpb
from .weights import _raw_view

try:
    import xxhash
except ImportError:  # crc32 then: slower, same guarantees against torn or mixed files
    xxhash = None

PROBE_PREFIX, FILE_PREFIX = "rlhf-probe-", "rlhf-weights-"
PIECE_BYTES = 16 << 20
STEP = 2 << 20  # a piece is checked in steps this size: its checksum and finiteness read it from cache
MIN_PIECE, MAX_PIECE = 1 << 16, 1 << 30
MAX_HEADER = 100 << 20  # safetensors' own limit
MADV_POPULATE_READ = 22  # Linux 5.14+: map the file's pages up front, read-only (copy on write)
MADV_POPULATE_WRITE = 23  # Linux 5.14+: the same, writable (the writer's mapping)
ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}


def default_digest() -> str:
    return "xxh3_64" if xxhash is not None else "crc32"


class _Crc32:
    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def intdigest(self) -> int:
        return self.value


def _hasher(kind: str):
    if kind == "xxh3_64" and xxhash is not None:
        return xxhash.xxh3_64()
    if kind == "crc32":
        return _Crc32()
    raise BadRequest(f"shm.digest: {kind!r} is not available here (xxh3_64 needs the xxhash package; crc32 always "
                     f"works)")


def _threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _safe(run_id: str) -> str:
    return re.sub(r"[^0-9A-Za-z_.]", "_", run_id)[:64] or "_"


def weights_file_name(run_id: str, epoch: int, version: int, fmt: str) -> str:
    return f"{FILE_PREFIX}{_safe(run_id)}-e{int(epoch)}-v{int(version)}-{fmt}.safetensors"


# ------------------------------------------------------------------ co-location
def colocated(shm_dir: str | None, nonce) -> bool:
    """Does `shm_dir` hold the probe of the server that advertised `nonce` (the same volume)?"""
    if not shm_dir or not isinstance(nonce, str) or not re.fullmatch(r"[0-9a-f]{32}", nonce):
        return False
    try:
        return (Path(shm_dir) / f"{PROBE_PREFIX}{nonce}").read_text() == nonce
    except OSError:
        return False


# ------------------------------------------------------------------ writing (the learner)
def _layout(tensors: Mapping[str, torch.Tensor], meta: dict[str, str]) -> tuple[bytes, list, int]:
    """The header bytes (length prefix included), [(file offset, tensor)] and the file's size."""
    order = sorted(tensors, key=lambda k: -tensors[k].element_size())  # stable: dtype alignment
    entries, off, placed = {}, 0, []
    for name in order:
        t = tensors[name]
        n = t.numel() * t.element_size()
        entries[name] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
        placed.append((off, t))
        off += n
    body = json.dumps({"__metadata__": meta, **entries}, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % 64)  # the data starts 64-byte aligned
    start = 8 + len(body)
    return len(body).to_bytes(8, "little") + body, [(start + o, t) for o, t in placed], start + off


def _fill(out: np.ndarray, segments: list, piece: int, kind: str, pool) -> list[int]:
    """Copy the file made of `segments` ([(offset, uint8 array)], contiguous, sorted) into `out`
    (the file's mapping), every piece [i*piece, (i+1)*piece) on a thread of `pool`, in steps whose
    checksum is taken from the copy while it is in cache; the pieces' checksums."""
    starts, size = [o for o, _ in segments], len(out)

    def one(i: int) -> int:
        lo, hi = i * piece, min(size, (i + 1) * piece)
        h = _hasher(kind)
        k = max(0, bisect.bisect_right(starts, lo) - 1)
        while k < len(segments) and segments[k][0] < hi:
            off, data = segments[k]
            for a in range(max(lo, off), min(hi, off + len(data)), STEP):
                z = min(hi, off + len(data), a + STEP)
                out[a:z] = data[a - off:z - off]
                h.update(out[a:z])
            k += 1
        return h.intdigest()
    return list(pool.map(one, range(math.ceil(size / piece))))


class SharedWeightsWriter:
    """The learner's side: writes each version once into `shm_dir` and says where (`write`)."""

    def __init__(self, shm_dir: str | os.PathLike, run_id: str, digest: str | None = None):
        self.dir, self.run_id = Path(shm_dir), run_id
        self.digest = digest or default_digest()
        self._current: dict[str, str] = {}  # format -> our newest file's name (recycled next time)
        self._maps: dict[str, tuple[tuple, mmap.mmap]] = {}  # format -> (file identity, our mapping of it)
        self.recycled = 0

    def cleanup(self) -> int:
        """Remove every file of this run (any epoch, finished or not); how many."""
        prefix, n = f"{FILE_PREFIX}{_safe(self.run_id)}-", 0
        self._current.clear()
        for fmt in list(self._maps):
            self._unmap(fmt)
        for p in self.dir.glob(f"{prefix}*"):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                n += 1
        return n

    def _claim(self, fmt: str, tmp: Path) -> int:
        """An open, exclusively locked file at `tmp`: our previous file of this format when no
        reader holds it (its pages are reused), else a new one."""
        prev = self._current.pop(fmt, None)
        if prev is not None:
            try:
                os.rename(self.dir / prev, tmp)
            except FileNotFoundError:
                pass
            else:
                fd = os.open(tmp, os.O_RDWR | os.O_NOFOLLOW)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    self.recycled += 1
                    return fd
                except BlockingIOError:  # a server still reads it: it keeps its mapping, we take new pages
                    os.close(fd)
                    tmp.unlink()
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd

    def _unmap(self, fmt: str) -> None:
        old = self._maps.pop(fmt, None)
        if old is not None:
            old[1].close()

    def _mapping(self, fmt: str, fd: int, path: Path, size: int) -> mmap.mmap:
        """Our writable mapping of the claimed file `fd` (at `path`), resized to `size`: the one
        kept from the last version when the file is the same (recycled, same size), so its pages
        need no mapping again; else a new one, its pages mapped up front. The file's pages are
        allocated first: a full tmpfs is an OSError here (the push streams instead), never a
        SIGBUS on a write through the mapping. Mapped through an open file of its own: a mapping
        keeps its file open, and the lock taken through `fd` must go when `fd` is closed."""
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino, size)
        old = self._maps.get(fmt)
        if old is not None and old[0] == key and st.st_size == size:
            return old[1]
        self._unmap(fmt)
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
        own = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            if os.fstat(own).st_ino != st.st_ino:
                raise OSError(f"{path} was replaced while it was written")
            mm = mmap.mmap(own, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(own)
        with contextlib.suppress(OSError, ValueError, AttributeError):
            mm.madvise(MADV_POPULATE_WRITE)
        self._maps[fmt] = (key, mm)
        return mm

    def write(self, state: Mapping[str, torch.Tensor], version: int, epoch: int = 0,
              fmt: str = "full") -> gpb.SharedWeights:
        """Write `state` as policy `version` and return the request that tells a server to load it.
        The tensors are copied into our mapping of the file in parallel, each piece checksummed
        from the copy."""
        tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
        bad = [k for k, t in tensors.items() if t.dtype not in ST_DTYPES]
        if bad:
            raise TypeError(f"dtype {tensors[bad[0]].dtype} of {bad[0]!r} cannot be shared")
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        meta = {"format": "pt", "rlhf.version": str(int(version)), "rlhf.run_id": self.run_id,
                "rlhf.epoch": str(int(epoch)), "rlhf.format": fmt}
        head, placed, size = _layout(tensors, meta)
        segments = [(0, np.frombuffer(head, dtype=np.uint8))] + [(off, _raw_view(t)) for off, t in placed if t.numel()]
        name = weights_file_name(self.run_id, epoch, version, fmt)
        tmp = self.dir / f"{FILE_PREFIX}{_safe(self.run_id)}-e{int(epoch)}-{fmt}.writing"
        fd = self._claim(fmt, tmp)
        try:
            out = np.frombuffer(self._mapping(fmt, fd, tmp, size), dtype=np.uint8)
            try:
                with ThreadPoolExecutor(_threads()) as pool:
                    digests = _fill(out, segments, PIECE_BYTES, self.digest, pool)
            finally:
                del out  # the mapping's only export: it can be closed (cleanup, a new file) from here on
        except BaseException:
            os.close(fd)
            self._unmap(fmt)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)  # releases the lock; nobody opens a temporary name
        os.rename(tmp, self.dir / name)
        self._current[fmt] = name
        header = pb.WeightHeader(version=int(version), format=fmt, num_tensors=len(tensors), total_bytes=total,
                                 run_id=self.run_id, epoch=int(epoch))
        return gpb.SharedWeights(file_name=name, file_bytes=size, header=header, piece_bytes=PIECE_BYTES,
                                 digest=self.digest, piece_digests=digests)

    def files(self) -> list[str]:
        return sorted(self._current.values())
