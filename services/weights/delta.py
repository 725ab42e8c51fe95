"""Delta pushes (`rpc.delta_push`): a version sent as what changed since a version the server
holds (its base), lossless. Per piece of raw bytes: the XOR of the new bytes with the base's (an
optimiser step leaves the sign, the exponent and the high mantissa bits of almost every weight as
they were, so those bytes of the XOR are zero), regrouped into planes by byte position within an
element (all first bytes, then all second bytes, ...: the zero planes become long runs), then one
zstd frame at level 1 (`TensorPiece.XOR_PLANES_ZSTD`). Decoding is the same in reverse, bounded
by the piece's declared range; the piece's checksum is of the decoded (new) bytes, so a delta
version is checked exactly as a full one, and one applied to the wrong base fails that check.

Measured on SmolLM2-135M (docs/speed.md, "Delta pushes"): zstd level 1 compresses these planes
at 0.45-0.75 GB/s a core, 3-10 times zlib level 1's speed at a better ratio; negative levels are
faster but send 7-52% more bytes, level 3 is slower and saves nothing more. A float32 version
after 1 and 10 AdamW steps goes as 40% and 58% of its bytes (the planes alone save a fifth).

zstandard is a dependency; where it is missing, delta pushes are off (`available()`), as a
missing xxhash means crc32."""

from __future__ import annotations

import threading

import numpy as np

from ..common.rpc.errors import BadRequest
from ..common.rpc.gen import common_pb2 as pb

try:
    import zstandard
except ImportError:  # no delta pushes: every version goes whole
    zstandard = None  # type: ignore[assignment]

LEVEL = 1  # zstd's level: see the module's docstring
XOR_PLANES_ZSTD = pb.TensorPiece.XOR_PLANES_ZSTD
RAW = pb.TensorPiece.RAW

_local = threading.local()  # a zstd context per thread (one is not safe to share)


def available() -> bool:
    return zstandard is not None


def base_key(run_id: str, epoch: int, policy_version: int) -> str:
    """How a server's registry entry names the version it holds as a delta base (`delta_base`),
    and how the publisher names the version its delta is against: the run, the learner's epoch
    (a restarted learner starts over with a full push) and the version."""
    return f"{run_id}/e{int(epoch)}/v{int(policy_version)}"


def plane_width(itemsize: int, offset: int, n: int) -> int:
    """Bytes per element of a piece's planes: the dtype's size when the piece starts and ends on
    an element boundary, else 1 (no regrouping). Both ends compute it the same way."""
    return itemsize if itemsize > 1 and offset % itemsize == 0 and n % itemsize == 0 else 1


def _cctx():
    c = getattr(_local, "cctx", None)
    if c is None:
        c = _local.cctx = zstandard.ZstdCompressor(level=LEVEL)  # writes the content size
    return c


def _dctx():
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


def encode(new: np.ndarray, old: np.ndarray, itemsize: int, offset: int) -> bytes | None:
    """The XOR_PLANES_ZSTD encoding of `new` against `old` (uint8 arrays of one length, the bytes
    [offset, offset + len) of a tensor); None when it would not be smaller than `new` (the piece
    then goes RAW)."""
    n = len(new)
    k = plane_width(itemsize, offset, n)
    x = np.bitwise_xor(new, old)
    if k > 1:  # XOR, then one transposing copy: twice as fast as XOR-ing plane by plane (strided reads)
        planes = np.empty((k, n // k), dtype=np.uint8)
        np.copyto(planes, x.reshape(-1, k).T)
        x = planes
    out = _cctx().compress(x)
    return out if len(out) < n else None


def decode(data, n: int, itemsize: int, offset: int, old: np.ndarray, out: np.ndarray, where: str) -> None:
    """Decode an XOR_PLANES_ZSTD piece into `out` (n bytes, the tensor's new bytes) against `old`
    (the base's same bytes). The frame must declare exactly `n` bytes (n is bounded by the piece's
    checked range) and hold nothing else, so no input expands beyond what the piece declared."""
    try:
        size = zstandard.frame_content_size(data)
        if size != n:
            raise BadRequest(
                f"{where}: the zstd frame declares {'no' if size < 0 else size} content size, expected raw_bytes={n}"
            )
        planes = _dctx().decompress(data, max_output_size=n, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise BadRequest(f"{where}: not a zstd frame of {n} bytes ({e})") from None
    if len(planes) != n:  # (zstd checks the content size itself; never trust one check)
        raise BadRequest(f"{where}: the zstd frame decoded to {len(planes)} bytes, expected {n}")
    k = plane_width(itemsize, offset, n)
    p = np.frombuffer(planes, dtype=np.uint8).reshape(k, -1)
    o, b = out.reshape(-1, k), old.reshape(-1, k)
    for j in range(k):
        np.bitwise_xor(p[j], b[:, j], out=o[:, j])


class Base:
    """The version a server holds as its delta base: (run_id, epoch, policy_version) and the raw
    bytes of every tensor (a host copy of the model: what `rpc.delta_push` costs a server)."""

    def __init__(self, run_id: str, epoch: int, policy_version: int, tensors: dict):
        self.run_id, self.epoch, self.policy_version = run_id, int(epoch), int(policy_version)
        self.tensors = tensors

    @property
    def key(self) -> str:
        return base_key(self.run_id, self.epoch, self.policy_version)
