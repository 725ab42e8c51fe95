"""Weights through shared memory, both ends (the learner's writer, in shm_writer.py; here the
co-location check, the server's probe, mappings and checked read): the fast path from the learner
to the generation servers on its host, beside the gRPC stream (`stream.py`), which stays the path
to every other server.

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
import secrets
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

import torch

from ..common.rpc.codec import checked_shape
from ..common.rpc.errors import BadRequest
from ..common.rpc.gen import common_pb2 as pb
from ..common.rpc.gen import generation_pb2 as gpb
from .check import all_finite, check_coverage, check_header, check_tensor
from .protocol import (
    FILE_PREFIX,  # noqa: F401 (the files' names start with it; importable from here as before)
    MAX_HEADER,
    MAX_PIECE,
    MIN_PIECE,
    PROBE_PREFIX,
    ST_NAMES,
    STEP,
    hasher,
    threads,
    weights_file_name,
)
from .shm_writer import SharedWeightsWriter  # noqa: F401 (the learner's side, importable from here as before)

MADV_POPULATE_READ = 22  # Linux 5.14+: map the file's pages up front, read-only (copy on write)


# ------------------------------------------------------------------ co-location
def colocated(shm_dir: str | None, nonce) -> bool:
    """Does `shm_dir` hold the probe of the server that advertised `nonce` (the same volume)?"""
    if not shm_dir or not isinstance(nonce, str) or not re.fullmatch(r"[0-9a-f]{32}", nonce):
        return False
    try:
        return (Path(shm_dir) / f"{PROBE_PREFIX}{nonce}").read_text() == nonce
    except OSError:
        return False


# ------------------------------------------------------------------ reading (the generation server)
class Mappings:
    """A server's mappings of the learner's files, kept from version to version: the learner
    writes each version over its previous file (same inode, same size), so the pages stay mapped
    and the next load neither maps nor unmaps them (both cost about as much as reading them). One
    per format; a different file replaces it; `close` releases all."""

    def __init__(self):
        self._maps: dict[str, tuple[tuple, mmap.mmap]] = {}
        self._lock = threading.Lock()

    def get(self, fmt: str, path: str, st: os.stat_result) -> mmap.mmap:
        key = (st.st_dev, st.st_ino, st.st_size)
        with self._lock:
            old = self._maps.pop(fmt, None)
            if old is not None and old[0] == key:
                self._maps[fmt] = old
                return old[1]
            if old is not None:
                _release([old[1]])
                old = None
            mm = _map(path, st)
            self._maps[fmt] = (key, mm)
            return mm

    def drop(self, fmt: str) -> None:
        with self._lock:
            old = self._maps.pop(fmt, None)
        if old is not None:
            _release([old[1]])

    def close(self) -> None:
        for fmt in list(self._maps):
            self.drop(fmt)


class Probe:
    """A generation server's proof of its shared-memory directory: a file named by a random nonce
    (advertised in its registry entry), removed when the server stops; and its `Mappings`."""

    def __init__(self, shm_dir: str | os.PathLike):
        self.mappings = Mappings()
        self.dir = Path(shm_dir)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.nonce = secrets.token_hex(16)
        self.path = self.dir / f"{PROBE_PREFIX}{self.nonce}"
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.nonce)

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        self.mappings.close()


def _parse(mm, size: int, where: str) -> tuple[list, dict, int]:
    """[(begin, end, name, dtype, shape)] sorted by offset, the metadata and the data's start."""
    n = int.from_bytes(mm[:8], "little") if size >= 8 else -1
    if not 0 < n <= min(size - 8, MAX_HEADER):
        raise BadRequest(f"{where}: header length {n} does not fit the file's {size} bytes")
    try:
        header = json.loads(bytes(mm[8 : 8 + n]))
    except ValueError:
        raise BadRequest(f"{where}: the header is not JSON (not a safetensors file, or corrupt)") from None
    if not isinstance(header, dict):
        raise BadRequest(f"{where}: the header is not a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise BadRequest(f"{where}: __metadata__ must map names to strings")
    entries = []
    for name, e in header.items():
        ok = (
            isinstance(e, dict)
            and e.get("dtype") in ST_NAMES
            and isinstance(e.get("shape"), list)
            and isinstance(e.get("data_offsets"), list)
            and len(e["data_offsets"]) == 2
            and all(isinstance(x, int) and x >= 0 for x in e["shape"] + e["data_offsets"])
        )
        if not ok:
            raise BadRequest(f"{where}: tensor {name!r}: bad entry {str(e)[:200]}")
        dtype, (b, end) = ST_NAMES[e["dtype"]], e["data_offsets"]
        # no more than the file spans, and nothing whose product overflows torch's sizes
        checked_shape(
            e["shape"], dtype.itemsize, f"{where}: tensor {name!r}", max_bytes=max(size, 1 << 30), dtype_name=e["dtype"]
        )
        if end - b != math.prod(e["shape"]) * dtype.itemsize:
            raise BadRequest(
                f"{where}: tensor {name!r}: offsets [{b}, {end}) do not fit shape {e['shape']} of {e['dtype']}"
            )
        entries.append((b, end, name, dtype, tuple(e["shape"])))
    entries.sort(key=lambda x: (x[0], x[1]))
    pos, start = 0, 8 + n
    for b, end, name, _, _ in entries:
        if b != pos:
            raise BadRequest(f"{where}: tensor {name!r} starts at {b}, expected {pos} (a hole or an overlap)")
        pos = end
    if start + pos != size:
        raise BadRequest(f"{where}: the tensors end at byte {start + pos} of a {size}-byte file")
    return entries, meta, start


def _check_entries(entries, meta: dict, h: pb.WeightHeader, specs, where: str) -> None:
    want = {
        "rlhf.policy_version": str(h.policy_version),
        "rlhf.run_id": h.run_id,
        "rlhf.epoch": str(h.epoch),
        "rlhf.format": h.format,
    }
    wrong = {k: meta.get(k) for k, v in want.items() if meta.get(k) != v}
    if wrong:
        raise BadRequest(f"{where}: metadata {wrong} disagree with the request ({want}): another version's file")
    if len(entries) != h.num_tensors:
        raise BadRequest(f"{where}: {len(entries)} tensors, the request announced {h.num_tensors}")
    total = sum(end - b for b, end, *_ in entries)
    if total != h.total_bytes:
        raise BadRequest(f"{where}: {total} bytes of tensors, the request announced total_bytes={h.total_bytes}")
    if specs is None:
        return
    for _, _, name, dtype, shape in entries:
        check_tensor(name, shape, dtype, specs, where)
    check_coverage((e[2] for e in entries), specs, h.format, where)


def _check_request(req: gpb.SharedWeights) -> tuple[str, int, int]:
    """The request's file name, size and piece size, each checked against its header."""
    h = req.header
    expected = weights_file_name(h.run_id, h.epoch, h.policy_version, h.format)
    if req.file_name != expected:
        raise BadRequest(f"shm.file_name: {req.file_name!r}, expected {expected!r} for this header")
    size, piece = int(req.file_bytes), int(req.piece_bytes)
    if not MIN_PIECE <= piece <= MAX_PIECE:
        raise BadRequest(f"shm.piece_bytes: {piece} outside [{MIN_PIECE}, {MAX_PIECE}]")
    if size < 8 or len(req.piece_digests) != math.ceil(size / piece):
        raise BadRequest(f"shm: {len(req.piece_digests)} piece checksums for {size} bytes in pieces of {piece}")
    hasher(req.digest)
    return expected, size, piece


@contextlib.contextmanager
def open_shared_weights(
    shm_dir: str,
    req: gpb.SharedWeights,
    specs=None,
    max_bytes: int | None = None,
    on_header: Callable[[pb.WeightHeader], None] | None = None,
    mappings: Mappings | None = None,
) -> Iterator[tuple[int, str, dict[str, torch.Tensor], int, pb.WeightHeader]]:
    """Check a version the learner wrote into `shm_dir` and yield (policy_version, format, state dict,
    bytes, header), as `assemble_weights` returns them. The tensors view the file's mapping: use
    them (load them) inside the `with` block only, and drop them there; the file stays locked
    against rewriting until it ends. Anything wrong raises `BadRequest` before a tensor is
    yielded. With `mappings`, the mapping is kept for the next version (see `Mappings`)."""
    h = req.header
    check_header(h, specs, max_bytes)
    if on_header is not None:
        on_header(h)  # the fence: the run's learner, before the file is even opened
    expected, size, piece = _check_request(req)
    where = f"shm[{expected}]"
    path = os.path.join(shm_dir, expected)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)  # the lock's: closed at the end, unlocking
    except OSError as e:
        raise BadRequest(f"{where}: cannot open it in {shm_dir}: {e.strerror}") from None
    mm = None
    state: dict[str, torch.Tensor] | None = None
    try:
        st = _lock(fd, size, where)
        mm = mappings.get(h.format, path, st) if mappings is not None else _map(path, st)
        entries, meta, start = _parse(mm, size, where)
        _check_entries(entries, meta, h, specs, where)
        state = _views(mm, entries, start)
        _check_contents(mm, req, entries, start, state, where, size, piece)
        yield int(h.policy_version), h.format, state, int(h.total_bytes), h
    except BaseException:
        if mappings is not None:  # whatever went wrong, the next version maps afresh
            mappings.drop(h.format)
            mm = None
        raise
    finally:
        state = None
        os.close(fd)  # releases the shared lock
        if mm is not None and mappings is None:
            holder, mm = [mm], None
            _release(holder)


def _lock(fd: int, size: int, where: str) -> os.stat_result:
    """The opened file `fd` checked to be a regular file of `size` bytes, under a shared lock
    (refused while the learner holds it to rewrite it); its stat."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise BadRequest(f"{where}: not a regular file")
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise BadRequest(f"{where}: being rewritten by the learner (a newer version)") from None
    st = os.fstat(fd)  # locked: its size cannot change under the mapping from here on
    if st.st_size != size:
        raise BadRequest(f"{where}: {st.st_size} bytes, the learner wrote {size} (truncated or replaced)")
    return st


def _views(mm, entries, start: int) -> dict[str, torch.Tensor]:
    """The state dict: each tensor a view of the mapping (an empty one allocated)."""
    return {
        name: (
            torch.frombuffer(mm, dtype=dtype, count=math.prod(shape), offset=start + b).reshape(shape)
            if end > b
            else torch.empty(shape, dtype=dtype)
        )
        for b, end, name, dtype, shape in entries
    }


def _check_contents(mm, req: gpb.SharedWeights, entries, start: int, state, where: str, size: int, piece: int) -> None:
    """Every piece's checksum and every floating tensor's finiteness (`_check_pieces`), the first
    failure refused."""
    view = memoryview(mm)
    try:
        checked = _check_pieces(view, req, entries, start, state)
    finally:
        view.release()
    bad = [i for i, (ok, _) in enumerate(checked) if not ok]
    if bad:
        raise BadRequest(
            f"{where}: {req.digest} mismatch in {len(bad)} piece(s), first bytes "
            f"[{bad[0] * piece}, {min(size, (bad[0] + 1) * piece)}): not the file the learner wrote"
        )
    nonfinite = [name for _, names in checked for name in names]
    if nonfinite:
        raise BadRequest(f"{where}: tensor {nonfinite[0]!r} contains NaN or infinity")


def _map(path: str, st: os.stat_result) -> mmap.mmap:
    """The file at `path` (the one `st` describes) mapped copy-on-write, its pages mapped up front.
    Through an open file of its own: the mapping keeps that open, and with it any lock taken
    through it, so the reader's lock is taken through another (closed when the load ends)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        again = os.fstat(fd)
        if (again.st_dev, again.st_ino, again.st_size) != (st.st_dev, st.st_ino, st.st_size):
            raise BadRequest(f"shm[{os.path.basename(path)}]: replaced while it was opened")
        mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    with contextlib.suppress(OSError, ValueError, AttributeError):
        mm.madvise(MADV_POPULATE_READ)
    return mm


def _release(holder: list) -> None:
    """Let go of a mapping (`holder` holds the caller's last reference) on a background thread:
    unmapping takes a while, and not on the caller's time. It is never closed explicitly: tensors
    made from it (`torch.frombuffer` keeps the object, not a buffer export) keep it mapped until
    the last of them goes."""
    threading.Thread(target=holder.clear, name="shm-unmap", daemon=True).start()


def _check_pieces(view, req: gpb.SharedWeights, entries, start: int, state) -> list[tuple[bool, list[str]]]:
    """For every piece of the file, in parallel: (its checksum matches, the floating tensors with a
    NaN or infinity in it). Each piece is read once, in steps that stay in cache for both checks."""
    size, piece = len(view), int(req.piece_bytes)
    flat = {name: state[name].reshape(-1) for _, _, name, dtype, _ in entries if dtype.is_floating_point}
    spans = [(start + b, start + end, name, dtype.itemsize) for b, end, name, dtype, _ in entries if name in flat]
    begins = [s[0] for s in spans]

    def one(i: int) -> tuple[bool, list[str]]:
        lo, hi = i * piece, min(size, (i + 1) * piece)
        h, bad = hasher(req.digest), []
        k = max(0, bisect.bisect_right(begins, lo) - 1)
        for a in range(lo, hi, STEP):
            z = min(hi, a + STEP)
            h.update(view[a:z])
            while k < len(spans) and spans[k][0] < z:
                b, e, name, item = spans[k]
                x, y = max(a, b), min(z, e)
                if y > x and name not in bad and not all_finite(flat[name][(x - b) // item : (y - b) // item]):
                    bad.append(name)
                if e > z:
                    break
                k += 1
        return h.intdigest() == req.piece_digests[i], bad

    with ThreadPoolExecutor(threads()) as pool:
        return list(pool.map(one, range(len(req.piece_digests))))
