"""assemble_weights on its own: the rules that hold with or without the model's specs (the servers
always pass specs; tests/generation/test_server.py pushes the same cases over gRPC)."""

import pytest
import torch

from services.common.rpc.errors import BadRequest
from services.weights.assemble import assemble_weights
from services.weights.stream import StreamSpec, weight_chunks
from tests.grpc_helpers import restream

STATE = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5, dtype=torch.int64)}
SPECS = {k: (tuple(t.shape), t.dtype) for k, t in STATE.items()}


def _pieces(chunks, name):
    return [c.piece for c in chunks if c.WhichOneof("payload") == "piece" and c.piece.name == name]


def test_round_trip_in_any_piece_order_with_the_header():
    chunks = list(weight_chunks(STATE, StreamSpec(3, chunk_bytes=8, run_id="run-a", epoch=7)))
    body = chunks[1:-1]
    shuffled = [chunks[0], *reversed(body), chunks[-1]]
    for specs in (SPECS, None):
        policy_version, fmt, state, nbytes, header = assemble_weights(iter(restream(list(shuffled))), specs)
        assert (policy_version, fmt, nbytes, header.run_id, header.epoch) == (3, "full", 48 + 40, "run-a", 7)
        assert all(torch.equal(state[k], STATE[k]) for k in STATE)


def test_the_header_callback_runs_before_any_piece():
    seen = []

    def on_header(h):
        seen.append(h.policy_version)
        raise BadRequest("refused")

    chunks = list(weight_chunks(STATE, StreamSpec(3)))
    chunks[1].piece.xxh3 ^= 1  # would be refused if read
    with pytest.raises(BadRequest, match="refused"):
        assemble_weights(iter(chunks), SPECS, on_header=on_header)
    assert seen == [3]


@pytest.mark.parametrize("specs", [SPECS, None])
@pytest.mark.parametrize(
    "tamper,fragment",
    [
        (lambda ch: _pieces(ch, "a")[1].CopyFrom(_pieces(ch, "a")[0]), "bytes [0, 8) were already received"),
        (lambda ch: setattr(_pieces(ch, "a")[1], "offset", 4), "bytes [4, 12) were already received"),
        (
            lambda ch: ch.remove(next(c for c in ch if c.piece.name == "a" and c.piece.offset == 16)),
            "bytes [16, 24) missing",
        ),
        (
            lambda ch: setattr(_pieces(ch, "a")[2], "total_bytes", 64),
            "total_bytes 64 disagree with the tensor's earlier",
        ),
        (lambda ch: setattr(_pieces(ch, "a")[2], "dtype", "int32"), "disagree with the tensor's earlier pieces"),
        (lambda ch: _pieces(ch, "a")[2].shape.__setitem__(0, 6), "disagree with the tensor's earlier pieces"),
        (lambda ch: setattr(_pieces(ch, "a")[0], "total_bytes", 2**62), ".total_bytes: 4611686018427387904"),
        (lambda ch: setattr(_pieces(ch, "a")[0], "offset", -8), "bytes [-8, 0) outside"),
        (lambda ch: setattr(ch[0].header, "total_bytes", -1), "weights.header.total_bytes: -1 is negative"),
        (lambda ch: setattr(ch[0].header, "total_bytes", 200), "total_bytes"),
        (lambda ch: setattr(ch[0].header, "num_tensors", 0), "weights.header.num_tensors: 0"),
        (lambda ch: setattr(ch[0].header, "format", ""), "weights.header.format: '' is not one of full, partial"),
    ],
)
def test_refused(specs, tamper, fragment):
    chunks = list(weight_chunks(STATE, StreamSpec(1, chunk_bytes=8)))
    tamper(chunks)
    with pytest.raises(BadRequest) as e:
        assemble_weights(iter(restream(chunks)), specs, max_bytes=1000)
    assert fragment in str(e.value)


def test_full_needs_every_tensor_partial_a_complete_subset():
    only_a = {"a": STATE["a"]}
    with pytest.raises(BadRequest, match="a full push without 1 of the model's tensors: b"):
        assemble_weights(weight_chunks(only_a, StreamSpec(1)), SPECS)
    _, fmt, state, _, _ = assemble_weights(weight_chunks(only_a, StreamSpec(1, kind="partial")), SPECS)
    assert fmt == "partial" and list(state) == ["a"]
    with pytest.raises(BadRequest, match="weights.header.format: 'sparse'"):
        assemble_weights(weight_chunks(only_a, StreamSpec(1, kind="sparse")), SPECS)
    # a delta (changes since a version the server holds) is every tensor too
    from services.weights.delta import Base

    with pytest.raises(BadRequest, match="a delta push without 1 of the model's tensors: b"):
        assemble_weights(
            weight_chunks(only_a, StreamSpec(2, kind="delta", base=only_a, base_version=1)),
            SPECS,
            base=Base("", 0, 1, STATE),
        )


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused(bad):
    state = dict(STATE, a=STATE["a"].clone())
    state["a"][1, 2] = bad
    with pytest.raises(BadRequest, match=r"weights.piece\[a\]: contains NaN or infinity"):
        assemble_weights(weight_chunks(state, StreamSpec(1)), SPECS)


def _legacy(chunks):
    """`chunks` as a writer without xxhash sends them: crc32 per piece, sha256 in the footer."""
    import hashlib
    import zlib

    digest = hashlib.sha256()
    for c in chunks:
        if c.WhichOneof("payload") == "piece":
            c.piece.ClearField("xxh3")
            c.piece.crc32 = zlib.crc32(c.piece.data)
            digest.update(c.piece.data)
    chunks[-1].footer.sha256 = digest.hexdigest()
    return chunks


def test_pieces_carry_xxh3_and_a_corrupt_piece_is_refused():
    chunks = list(weight_chunks(STATE, StreamSpec(3, chunk_bytes=8)))
    pieces = [c.piece for c in chunks if c.WhichOneof("payload") == "piece"]
    assert all(p.HasField("xxh3") for p in pieces) and not chunks[-1].footer.sha256
    pieces[1].data = bytes(len(pieces[1].data))
    with pytest.raises(BadRequest, match="xxh3 mismatch"):
        assemble_weights(iter(chunks), SPECS)


def test_a_writer_without_xxhash_is_still_understood_and_checked():
    policy_version, _, state, _, _ = assemble_weights(
        iter(_legacy(list(weight_chunks(STATE, StreamSpec(3, chunk_bytes=8))))), SPECS
    )
    assert policy_version == 3 and all(torch.equal(state[k], STATE[k]) for k in STATE)
    bad = _legacy(list(weight_chunks(STATE, StreamSpec(3, chunk_bytes=8))))
    bad[-1].footer.sha256 = "0" * 64
    with pytest.raises(BadRequest, match="sha256: checksum mismatch"):
        assemble_weights(iter(bad), SPECS)


def test_one_kind_of_check_per_push():
    mixed = list(weight_chunks(STATE, StreamSpec(3, chunk_bytes=8)))
    mixed[2].piece.ClearField("xxh3")  # this piece would be checked by crc32 only
    with pytest.raises(BadRequest, match="xxh3 on some pieces"):
        assemble_weights(iter(mixed), SPECS)
    signed = list(weight_chunks(STATE, StreamSpec(3, chunk_bytes=8)))
    signed[-1].footer.sha256 = "0" * 64
    with pytest.raises(BadRequest, match="set in a push whose pieces carry xxh3"):
        assemble_weights(iter(signed), SPECS)
