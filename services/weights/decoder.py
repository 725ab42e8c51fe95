"""Weights over gRPC, the receiver's first step: the PushWeights request deserializer
(`WeightChunkDecoder`), which hands a piece's data on as a view of the received message, without
a copy. What the pieces become is assemble.py."""

from __future__ import annotations

from ..common.rpc.gen import common_pb2 as pb


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
