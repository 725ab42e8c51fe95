"""Weights through shared memory, the learner's side (`SharedWeightsWriter`): each version written
once into `rpc.shm_dir` for every co-located server, checksummed piece by piece as it is copied in,
and the request that tells a server where it is. What the file holds, how a server checks and maps
it, and why pages are recycled under locks: shm.py, which holds the server's side.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import json
import math
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Mapping

import numpy as np
import torch

from ..common.rpc.gen import common_pb2 as pb
from ..common.rpc.gen import generation_pb2 as gpb
from .protocol import (
    CHUNK_BYTES,
    FILE_PREFIX,
    ST_DTYPES,
    STEP,
    default_digest,
    hasher,
    raw_view,
    safe_run_id,
    threads,
    weights_file_name,
)

MADV_POPULATE_WRITE = 23  # Linux 5.14+: map the file's pages up front, writable (the writer's mapping)


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
        h = hasher(kind)
        k = max(0, bisect.bisect_right(starts, lo) - 1)
        while k < len(segments) and segments[k][0] < hi:
            off, data = segments[k]
            for a in range(max(lo, off), min(hi, off + len(data)), STEP):
                z = min(hi, off + len(data), a + STEP)
                out[a:z] = data[a - off : z - off]
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
        prefix, n = f"{FILE_PREFIX}{safe_run_id(self.run_id)}-", 0
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

    def _copy_in(self, fmt: str, tmp: Path, size: int, segments: list) -> list[int]:
        """The file's bytes (`segments`, see `_fill`) copied into a claimed file at `tmp` of `size`
        bytes, through our mapping, in parallel; the pieces' checksums. The lock is released at
        the end; a copy that fails removes the file."""
        fd = self._claim(fmt, tmp)
        try:
            out = np.frombuffer(self._mapping(fmt, fd, tmp, size), dtype=np.uint8)
            try:
                with ThreadPoolExecutor(threads()) as pool:
                    digests = _fill(out, segments, CHUNK_BYTES, self.digest, pool)
            finally:
                del out  # the mapping's only export: it can be closed (cleanup, a new file) from here on
        except BaseException:
            os.close(fd)
            self._unmap(fmt)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)  # releases the lock; nobody opens a temporary name
        return digests

    def write(
        self, state: Mapping[str, torch.Tensor], policy_version: int, epoch: int = 0, fmt: str = "full"
    ) -> gpb.SharedWeights:
        """Write `state` as `policy_version` and return the request that tells a server to load it.
        The tensors are copied into our mapping of the file in parallel, each piece checksummed
        from the copy."""
        tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
        bad = [k for k, t in tensors.items() if t.dtype not in ST_DTYPES]
        if bad:
            raise TypeError(f"dtype {tensors[bad[0]].dtype} of {bad[0]!r} cannot be shared")
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        meta = {
            "format": "pt",
            "rlhf.policy_version": str(int(policy_version)),
            "rlhf.run_id": self.run_id,
            "rlhf.epoch": str(int(epoch)),
            "rlhf.format": fmt,
        }
        head, placed, size = _layout(tensors, meta)
        segments = [(0, np.frombuffer(head, dtype=np.uint8))] + [(off, raw_view(t)) for off, t in placed if t.numel()]
        name = weights_file_name(self.run_id, epoch, policy_version, fmt)
        tmp = self.dir / f"{FILE_PREFIX}{safe_run_id(self.run_id)}-e{int(epoch)}-{fmt}.writing"
        digests = self._copy_in(fmt, tmp, size, segments)
        os.rename(tmp, self.dir / name)
        self._current[fmt] = name
        header = pb.WeightHeader(
            policy_version=int(policy_version),
            format=fmt,
            num_tensors=len(tensors),
            total_bytes=total,
            run_id=self.run_id,
            epoch=int(epoch),
        )
        return gpb.SharedWeights(
            file_name=name,
            file_bytes=size,
            header=header,
            piece_bytes=CHUNK_BYTES,
            digest=self.digest,
            piece_digests=digests,
        )
