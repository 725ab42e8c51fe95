"""The fast weight-push path: `encode_weights` (serialised once), `Fanout` (one encoding read by
many streams, bounded), `WeightChunkDecoder` (pieces decoded without copying their data) and the
finiteness check; each must accept and refuse exactly what the plain protobuf path does."""

import threading

import pytest
import torch

from services.common.rpc.errors import BadRequest
from services.common.rpc.gen import common_pb2 as pb
from services.weights.assemble import assemble_weights
from services.weights.check import all_finite
from services.weights.decoder import WeightChunkDecoder
from services.weights.stream import Fanout, StreamSpec, _varint, encode_weights, weight_chunks

STATE = {
    "big": torch.randn(300, 400),
    "half": torch.randn(70_001).to(torch.bfloat16),
    "ids": torch.arange(5, dtype=torch.int64),
    "empty": torch.zeros(0, 3),
    "flag": torch.tensor(True),
}
SPECS = {k: (tuple(t.shape), t.dtype) for k, t in STATE.items()}


@pytest.mark.parametrize("chunk_bytes", [1 << 16, 100_000, 1 << 24])
def test_encoded_stream_is_the_protobuf_stream(chunk_bytes):
    raw = list(encode_weights(STATE, StreamSpec(4, chunk_bytes, run_id="r", epoch=2)))
    msgs = [pb.WeightChunk.FromString(b) for b in raw]
    assert [m.SerializeToString() for m in msgs] == [
        m.SerializeToString() for m in weight_chunks(STATE, StreamSpec(4, chunk_bytes, run_id="r", epoch=2))
    ]
    decoded = [WeightChunkDecoder().FromString(b) for b in raw]
    for fast, slow in zip(decoded, msgs):
        assert fast.WhichOneof("payload") == slow.WhichOneof("payload")
        if slow.WhichOneof("payload") == "piece":
            f, s = fast.piece, slow.piece
            assert (f.name, f.dtype, list(f.shape), f.offset, f.total_bytes, f.xxh3, bytes(f.data)) == (
                s.name,
                s.dtype,
                list(s.shape),
                s.offset,
                s.total_bytes,
                s.xxh3,
                s.data,
            )
    assert any(type(d).__name__ == "_PieceView" for d in decoded)  # the fast path was taken
    policy_version, fmt, state, nbytes, _ = assemble_weights(iter(decoded), SPECS)
    assert policy_version == 4 and all(torch.equal(state[k], STATE[k]) for k in STATE)


def test_decoder_leaves_odd_layouts_to_protobuf():
    n = 70_000
    first, second = b"\x32" + _varint(n) + b"x" * n, b"\x32" + _varint(n) + b"y" * n
    inner = pb.TensorPiece(name="big").SerializeToString() + first + second  # a repeated field: the last wins
    out = WeightChunkDecoder().FromString(b"\x12" + _varint(len(inner)) + inner)
    assert isinstance(out, pb.WeightChunk) and out.piece.name == "big" and out.piece.data == b"y" * n
    with pytest.raises(Exception):  # a length beyond the message: protobuf's own error
        WeightChunkDecoder().FromString(b"\x12\xff\xff\xff\xff\x0f" + b"\x00" * n)


def test_fanout_reads_one_encoding_in_every_stream_with_a_bounded_window():
    produced = []

    def source():
        for i in range(50):
            produced.append(i)
            yield bytes([i])

    fan = Fanout(source(), readers=3, window=4)
    seen = {i: [] for i in range(3)}

    def read(i):
        for chunk in fan.reader(i):
            seen[i].append(chunk[0])
            assert len(produced) - len(seen[i]) <= 4 + 1  # never far ahead of any reader

    threads = [threading.Thread(target=read, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    fan.join()
    assert produced == list(range(50)) and all(s == list(range(50)) for s in seen.values())


def test_a_detached_reader_does_not_hold_the_others():
    fan = Fanout((bytes([i]) for i in range(40)), readers=2, window=2)
    stuck = fan.reader(0)
    next(stuck)  # reads one, then stops (its RPC failed)
    fan.detach(0)
    assert [c[0] for c in fan.reader(1)] == list(range(40))
    fan.join()


def test_an_encoder_error_reaches_every_reader():
    def source():
        yield b"a"
        raise TypeError("dtype cannot go on the wire")

    fan = Fanout(source(), readers=2)
    for i in range(2):
        with pytest.raises(TypeError):
            list(fan.reader(i))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_finiteness_check(dtype, bad):
    for n in (1, 17, 4099, 1 << 16):
        t = torch.randn(n).to(dtype)
        assert all_finite(t)
        for pos in (0, n // 2, n - 1):
            u = t.clone()
            u[pos] = bad
            assert not all_finite(u)
    assert all_finite(torch.zeros(0, dtype=dtype)) and not all_finite(torch.tensor(bad, dtype=dtype))


def test_non_finite_found_in_a_large_piece_is_refused():
    state = {k: v.clone() for k, v in STATE.items()}
    state["big"][299, 399] = float("nan")
    decoded = [WeightChunkDecoder().FromString(b) for b in encode_weights(state, StreamSpec(1, 1 << 20))]
    with pytest.raises(BadRequest, match=r"weights.piece\[big\]: contains NaN or infinity"):
        assemble_weights(iter(decoded), SPECS)


def test_the_piece_size_leaves_room_for_metadata_under_any_message_limit():
    from services.weights.protocol import CHUNK_BYTES, chunk_bytes

    for mb in (1, 2, 8, 31, 32, 33, 256, 2047):
        assert chunk_bytes(mb) <= mb * (1 << 20) // 2 and chunk_bytes(mb) <= CHUNK_BYTES
    assert chunk_bytes(256) == CHUNK_BYTES
