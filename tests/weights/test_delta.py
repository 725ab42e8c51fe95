"""Delta pushes (`rpc.delta_push`, services/weights/delta.py): a version sent as what changed since
the one a server holds assembles bit for bit what the full push does (fp32 and bf16, xxh3 or
crc32); a server that missed a version, restarted, or whose registry entry is stale gets the full
version in the same push; a corrupt piece, a wrong base and a decompression bomb are refused. The
stream on its own, and real servers over loopback gRPC with the publisher."""

from types import SimpleNamespace

import grpc
import pytest
import torch
import zstandard

from services.common.rpc.errors import BadRequest, FailedPrecondition, Reason, reason_of
from services.common.rpc.gen import common_pb2 as pb
from services.generation.backend import HFBackend
from services.generation.client import GenerationClient
from services.generation.server import serve
from services.weights import assemble as assemble_module
from services.weights import delta
from services.weights import stream as stream_module
from services.weights.assemble import assemble_weights
from services.weights.check import check_header
from services.weights.decoder import WeightChunkDecoder
from services.weights.protocol import PushKind
from services.weights.publisher import Route
from services.weights.stream import StreamSpec, encode_weights, weight_chunks
from tests.grpc_helpers import closed, on_free_ports, publisher

XOR = pb.TensorPiece.XOR_PLANES_ZSTD


def _step(state: dict, seed: int, lr: float = 1e-3) -> dict:
    """One optimiser-like step: every floating weight moves by lr (what Adam's first step does);
    tensors of one shape alike (a tied embedding and head stay one tensor)."""

    def moved(v):
        g = torch.Generator().manual_seed(seed * 1_000_003 + sum(v.shape) * 31 + v.dim())
        return (v.float() - lr * torch.randn(v.shape, generator=g).sign()).to(v.dtype)

    return {k: moved(v) if v.is_floating_point() else v for k, v in state.items()}


def _same_bytes(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].reshape(-1).view(torch.uint8).equal(b[k].reshape(-1).view(torch.uint8))
        for k in a
    )


def _source(dtype) -> dict:
    torch.manual_seed(0)
    return {
        "big": torch.randn(300, 400).to(dtype),
        "odd": torch.randn(7, 1001).to(dtype),
        "ids": torch.arange(5, dtype=torch.int64),
        "empty": torch.zeros(0, 3, dtype=dtype),
        "flag": torch.tensor(True),
    }


def _specs(state):
    return {k: (tuple(t.shape), t.dtype) for k, t in state.items()}


def _assemble(chunks, specs, base):
    return assemble_weights(iter([WeightChunkDecoder().FromString(c) for c in chunks]), specs, base=base)


# ------------------------------------------------------------------ the stream
@pytest.mark.parametrize("checksum", ["xxh3", "crc32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_bytes", [1 << 16, 100_001, 1 << 24])  # 100_001: pieces split elements (1-byte planes)
def test_a_delta_assembles_the_full_push_bit_for_bit(dtype, chunk_bytes, checksum, monkeypatch):
    if checksum == "crc32":
        monkeypatch.setattr(stream_module, "xxhash", None)
        monkeypatch.setattr(assemble_module, "xxhash", None)
    old = _source(dtype)
    new = _step(old, 1)
    base = delta.Base("run-a", 2, 3, old)
    full = list(encode_weights(new, StreamSpec(4, chunk_bytes, run_id="run-a", epoch=2)))
    diff = list(encode_weights(new, StreamSpec(4, chunk_bytes, "delta", "run-a", 2, base=old, base_version=3)))
    pieces = [pb.WeightChunk.FromString(c).piece for c in diff[1:-1]]
    assert any(p.encoding == XOR for p in pieces)
    aligned = chunk_bytes % 4 == 0  # else the pieces' planes are of single bytes: less saved
    assert sum(map(len, diff)) < (0.6 if aligned else 0.8) * sum(map(len, full))
    # the same ranges with the same checksums (of the new bytes) as the full push's
    full_pieces = [pb.WeightChunk.FromString(c).piece for c in full[1:-1]]
    assert [(p.name, p.offset, p.raw_bytes or len(p.data), p.xxh3, p.crc32) for p in pieces] == [
        (p.name, p.offset, len(p.data), p.xxh3, p.crc32) for p in full_pieces
    ]
    v, fmt, got, nbytes, header = _assemble(diff, _specs(old), base)
    assert (v, fmt, header.base_policy_version) == (4, "delta", 3)
    _, _, whole, full_nbytes, _ = _assemble(full, _specs(old), None)
    assert _same_bytes(got, new) and _same_bytes(got, whole) and nbytes == full_nbytes
    assert _same_bytes(base.tensors, old)  # the base is read, never written


def test_a_piece_that_would_not_shrink_goes_raw():
    old = {**_source(torch.float32), "counts": torch.randint(-(2**63), 2**63 - 1, (20_000,))}
    new = {**_step(old, 1), "counts": torch.randint(-(2**63), 2**63 - 1, (20_000,))}  # a random XOR
    chunks = list(weight_chunks(new, StreamSpec(2, 1 << 16, "delta", base=old, base_version=1)))
    encodings = {(c.piece.name, c.piece.encoding) for c in chunks if c.WhichOneof("payload") == "piece"}
    assert {("counts", pb.TensorPiece.RAW), ("big", XOR)} <= encodings and ("counts", XOR) not in encodings
    _, _, got, _, _ = assemble_weights(iter(chunks), _specs(old), base=delta.Base("", 0, 1, old))
    assert _same_bytes(got, new)


def _delta_chunks(old, new, base_version=1, chunk_bytes=1 << 16):
    return list(
        weight_chunks(new, StreamSpec(base_version + 1, chunk_bytes, "delta", base=old, base_version=base_version))
    )


def _first_encoded(chunks):
    return next(c.piece for c in chunks if c.WhichOneof("payload") == "piece" and c.piece.encoding == XOR)


def test_a_corrupt_delta_piece_is_refused_by_its_checksum():
    old = _source(torch.float32)
    new = _step(old, 1)
    base = delta.Base("", 0, 1, old)
    chunks = _delta_chunks(old, new)
    p = _first_encoded(chunks)
    planes = bytearray(zstandard.ZstdDecompressor().decompress(p.data))
    planes[len(planes) // 2] ^= 0x01  # one bit of one weight, in a well-formed frame
    p.data = zstandard.ZstdCompressor(level=1).compress(bytes(planes))
    with pytest.raises(BadRequest, match=rf"weights.piece\[{p.name}\]: xxh3 mismatch at offset {p.offset}"):
        assemble_weights(iter(chunks), _specs(old), base=base)
    # a base one bit off decodes to other bytes than the learner's: refused the same way
    other = {k: v.clone() for k, v in old.items()}
    other["big"].view(-1).view(torch.int32)[7] ^= 1
    with pytest.raises(BadRequest, match="xxh3 mismatch"):
        assemble_weights(iter(_delta_chunks(old, new)), _specs(old), base=delta.Base("", 0, 1, other))


def test_a_delta_without_its_base_is_refused_with_a_reason():
    old = _source(torch.float32)
    chunks = list(weight_chunks(_step(old, 1), StreamSpec(8, 1 << 16, "delta", "run-a", 3, base=old, base_version=7)))
    for held, holds in [
        (None, "no delta base"),
        (delta.Base("run-a", 3, 6, old), "run-a/e3/v6"),  # it missed version 7
        (delta.Base("run-a", 2, 7, old), "run-a/e2/v7"),  # version 7 of another learner epoch
        (delta.Base("run-b", 3, 7, old), "run-b/e3/v7"),
    ]:
        with pytest.raises(
            FailedPrecondition, match=f"a delta against run-a/e3/v7, but this server holds {holds}"
        ) as e:
            assemble_weights(iter(chunks), _specs(old), base=held)
        assert e.value.reason is Reason.DELTA_BASE_MISSING
    assert assemble_weights(iter(chunks), _specs(old), base=delta.Base("run-a", 3, 7, old))[0] == 8


def _refused(chunks, old, fragment):
    """Refused before any checksum is compared: what is malformed is refused as such."""
    with pytest.raises(BadRequest, match=fragment):
        assemble_weights(iter(chunks), _specs(old), base=delta.Base("", 0, 1, old))


def test_decompression_bombs_and_malformed_pieces_are_refused():
    old = _source(torch.float32)
    new = _step(old, 1)
    fresh = lambda: _delta_chunks(old, new)  # noqa: E731

    chunks = fresh()  # a frame that expands to 64 MiB (~2 KB of it), declared as the piece's 64 KiB
    _first_encoded(chunks).data = zstandard.ZstdCompressor(level=1).compress(bytes(1 << 26))
    _refused(chunks, old, r"the zstd frame declares 67108864 content size, expected raw_bytes=65536")
    chunks = fresh()  # a frame that does not say how large it is
    p = _first_encoded(chunks)
    p.data = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(bytes(p.raw_bytes))
    _refused(chunks, old, "declares no content size")
    chunks = fresh()  # raw_bytes beyond the tensor: nothing is decoded
    p = _first_encoded(chunks)
    p.raw_bytes = p.total_bytes - p.offset + 1
    _refused(chunks, old, r"outside the tensor's")
    chunks = fresh()
    _first_encoded(chunks).raw_bytes = 0
    _refused(chunks, old, r"raw_bytes: 0, expected the piece's decoded length")
    chunks = fresh()  # bytes after the frame
    _first_encoded(chunks).data += b"tail"
    _refused(chunks, old, "not a zstd frame")
    chunks = fresh()
    _first_encoded(chunks).data = b"garbage"
    _refused(chunks, old, "not a zstd frame")
    chunks = fresh()
    _first_encoded(chunks).encoding = 7  # type: ignore[assignment]  # (proto3 keeps unknown values)
    _refused(chunks, old, r"encoding: 7 unknown")
    chunks = fresh()  # an encoded piece in a full push
    chunks[0].header.format, chunks[0].header.base_policy_version = "full", 0
    _refused(chunks, old, r"XOR_PLANES_ZSTD in a 'full' push")
    chunks = fresh()
    chunks[0].header.base_policy_version = chunks[0].header.policy_version
    _refused(chunks, old, r"base_policy_version: 2, expected in \[0, policy_version=2\)")
    full = list(weight_chunks(new, StreamSpec(2, 1 << 16)))
    full[0].header.base_policy_version = 1
    _refused(full, old, "base_policy_version: set in a 'full' version")
    # shared memory carries whole versions only
    with pytest.raises(BadRequest, match="'delta' is not one of full, partial"):
        check_header(fresh()[0].header, None, None)


# ------------------------------------------------------------------ real servers, the publisher
class Registry:
    """The replay registry as the publisher reads it: each live server's entry as its heartbeat
    writes it (`registry_info`), or as `stale` says (a restarted server's entry before its first
    heartbeat); the learner's writes after each push in `beats`."""

    def __init__(self, services):
        self.services, self.beats, self.stale = list(services), [], {}

    def live(self, kind):
        out = {}
        for s in self.services:
            address = f"127.0.0.1:{s.server.port}"
            out[address] = {"policy_version": s.servicer.backend.policy_version, **s.servicer.registry_info()}
            out[address].update(self.stale.pop(address, {}))
        return out

    def heartbeat(self, kind, address, **info):
        self.beats.append((address, info))

    def publish_learner(self, *args):
        pass


def _delta_cfg(cfg, on=True):
    return cfg.model_copy(update={"rpc": cfg.rpc.model_copy(update={"delta_push": on, "timeout_s": 30})})


def _server(cfg, model_dir, dtype):
    backend = HFBackend(model_dir, "cpu", dtype)
    if dtype != torch.float32:  # versions in the engine's own dtype (the HF backend takes float32 ones)
        backend._specs = {k: (s, dtype if d.is_floating_point else d) for k, (s, d) in backend._specs.items()}
    return serve(on_free_ports(cfg, "generation"), backend=backend)


def _weights(svc) -> dict:
    return {k: v.detach().clone() for k, v in svc.servicer.backend.model.state_dict().items()}


def _serves(svc, state) -> bool:
    got = svc.servicer.backend.model.state_dict()
    return _same_bytes({k: got[k] for k in state}, state)


class Learner:
    def __init__(self, state):
        self.state, self.device, self.lora = state, torch.device("cpu"), False

    def policy_state_dict(self):
        return self.state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_servers_get_deltas_and_whole_versions_as_each_needs(cfg, tiny_model_dir, dtype):
    on = _delta_cfg(cfg)
    with _server(on, tiny_model_dir, dtype) as a, _server(on, tiny_model_dir, dtype) as b:
        state = _weights(a)
        learner = Learner(state)
        reg = Registry([a, b])
        bc = publisher(on, reg, learner)
        bc.identity = ("run-a", 1)
        try:
            assert a.servicer.registry_info()["delta_base"] == ""  # nothing held yet
            learner.state = state = _step(state, 1)
            out = bc.push(1, "learner:1")  # no previous version: whole
            assert (out["push/failed"], out["push/delta"]) == (0, 0) and _serves(a, state) and _serves(b, state)
            assert a.servicer.registry_info()["delta_base"] == "run-a/e1/v1"
            assert {info["delta_base"] for _, info in reg.beats} == {"run-a/e1/v1"}  # the learner's writes too
            full_bytes = out["push/bytes"]

            learner.state = state = _step(state, 2)
            out = bc.push(2, "learner:1")
            assert (out["push/failed"], out["push/delta"]) == (0, 2) and _serves(a, state) and _serves(b, state)
            assert 0 < out["push/bytes"] < 0.75 * full_bytes  # one delta stream read by both
            assert b.servicer.registry_info()["delta_base"] == "run-a/e1/v2"

            reg.services = [a]  # b misses version 3
            learner.state = state = _step(state, 3)
            assert bc.push(3, "learner:1")["push/delta"] == 1 and _serves(a, state)
            reg.services = [a, b]
            assert b.servicer.registry_info()["delta_base"] == "run-a/e1/v2"  # and version 4's delta is against 3
            learner.state = state = _step(state, 4)
            out = bc.push(4, "learner:1")
            assert (out["push/failed"], out["push/delta"]) == (0, 1)
            assert _serves(a, state) and _serves(b, state) and b.servicer.backend.policy_version == 4

            # an entry that says b holds v4 while it holds nothing (it restarted; the entry is
            # its old process's): the delta is refused for its base, the full version streamed
            b.servicer.receiver.delta_base = None
            reg.stale[f"127.0.0.1:{b.server.port}"] = {"delta_base": "run-a/e1/v4"}
            learner.state = state = _step(state, 5)
            out = bc.push(5, "learner:1")
            assert (out["push/failed"], out["push/delta"]) == (0, 1)
            assert (f"127.0.0.1:{b.server.port}", "no-delta-base", 5) in bc.reach.told  # planned a delta, refused
            assert _serves(a, state) and _serves(b, state) and b.servicer.backend.policy_version == 5
            assert b.servicer.registry_info()["delta_base"] == "run-a/e1/v5"  # it holds the full version now
        finally:
            closed(bc)


def test_a_restarted_server_gets_the_whole_version(cfg, tiny_model_dir):
    on = _delta_cfg(cfg)
    with _server(on, tiny_model_dir, torch.float32) as a:
        learner = Learner(_step(_weights(a), 1))
        reg = Registry([a])
        bc = publisher(on, reg, learner)
        bc.identity = ("run-a", 1)
        try:
            bc.push(1, "learner:1")
            learner.state = _step(learner.state, 2)
            assert bc.push(2, "learner:1")["push/delta"] == 1
            with _server(on, tiny_model_dir, torch.float32) as again:  # a new process: no base
                reg.services = [again]
                assert again.servicer.registry_info()["delta_base"] == ""
                learner.state = _step(learner.state, 3)
                out = bc.push(3, "learner:1")
                assert (out["push/failed"], out["push/delta"]) == (0, 0) and _serves(again, learner.state)
                learner.state = _step(learner.state, 4)
                assert bc.push(4, "learner:1")["push/delta"] == 1 and _serves(again, learner.state)
        finally:
            closed(bc)


def test_a_delta_to_a_server_without_its_base_fails_with_the_reason(cfg, tiny_model_dir):
    for on in (True, False):  # a server that keeps no base (rpc.delta_push off) refuses the same way
        with _server(_delta_cfg(cfg, on), tiny_model_dir, torch.float32) as svc:
            assert ("delta_base" in svc.servicer.registry_info()) is on
            old = _weights(svc)
            client = GenerationClient(f"127.0.0.1:{svc.server.port}", cfg.rpc)
            with pytest.raises(grpc.RpcError) as e:
                client.push_encoded(
                    encode_weights(_step(old, 1), StreamSpec(1, kind="delta", base=old, base_version=0))
                )
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert reason_of(e.value) is Reason.DELTA_BASE_MISSING and "holds no delta base" in e.value.details()
            assert svc.servicer.backend.policy_version == 0 and _serves(svc, old)
            client.close()


def test_the_plan_picks_delta_or_full_per_server(cfg, tmp_path):
    state = {"w": torch.zeros(4)}
    learner = Learner(state)
    bc = publisher(_delta_cfg(cfg), Registry([]), learner)
    bc.identity = ("run-a", 1)
    try:
        info = lambda held, **kw: {"base": "run:run-a", "partial": True, "delta_base": held, **kw}  # noqa: E731
        bc.take_snapshot(1)
        assert bc.plan("s", info("run-a/e1/v1"), False) == Route(PushKind.FULL, "grpc")  # no previous snapshot yet
        learner.state = {"w": torch.ones(4)}
        bc.take_snapshot(2)
        assert bc.plan("s", info("run-a/e1/v1"), False) == Route(
            PushKind.DELTA, "grpc"
        )  # it holds the previous version
        for held in ("run-a/e1/v0", "run-a/e0/v1", "run-b/e1/v1", ""):  # behind, another epoch or run, none
            assert bc.plan("s", info(held), False) == Route(PushKind.FULL, "grpc")
        assert bc.plan("s", {"base": "run:run-a", "partial": True}, False) == Route(
            PushKind.FULL, "grpc"
        )  # keeps no base
        assert bc.plan("s", info("run-a/e1/v1"), True) == Route(PushKind.PARTIAL, "grpc")  # LoRA: partial as before
        bc.shared.colocated = lambda info: True  # type: ignore[method-assign]
        assert bc.plan("s", info("run-a/e1/v1"), False) == Route(PushKind.FULL, "shm")  # shared memory: whole
    finally:
        closed(bc)
    off = publisher(_delta_cfg(cfg, False), Registry([]), Learner(state))
    try:
        off.take_snapshot(1)
        off.take_snapshot(2)
        assert off._prev is None and off.plan("s", {"delta_base": "/e0/v1"}, False) == Route(PushKind.FULL, "grpc")
    finally:
        closed(off)


def test_a_lora_publisher_keeps_no_previous_snapshot(cfg):
    learner = SimpleNamespace(
        lora=True,
        device=torch.device("cpu"),
        policy_state_dict=lambda: {"w": torch.zeros(4), "frozen": torch.zeros(2)},
        policy_delta_state_dict=lambda: {"w": torch.ones(4)},
    )
    bc = publisher(_delta_cfg(cfg), Registry([]), learner)
    try:
        bc.take_snapshot(1)
        bc.take_snapshot(2)
        assert bc._prev is None
    finally:
        closed(bc)


def test_a_version_from_shared_memory_leaves_no_delta_base(cfg, tiny_model_dir, tmp_path):
    """Shared memory carries whole versions and the server keeps none of its mapped file: after
    such a version it holds no base (the learner plans it whole next time)."""
    from services.weights import shm

    on = _delta_cfg(cfg).model_copy(deep=True)
    on.rpc.shm_dir = str(tmp_path)
    with _server(on, tiny_model_dir, torch.float32) as svc:
        client = GenerationClient(f"127.0.0.1:{svc.server.port}", on.rpc)
        state = _step(_weights(svc), 1)
        client.update_weights(state, 1, run_id="run-a", epoch=2)
        assert svc.servicer.registry_info()["delta_base"] == "run-a/e2/v1"
        writer = shm.SharedWeightsWriter(tmp_path, "run-a")
        client.load_shared(writer.write(_step(state, 2), 2, 2))
        assert svc.servicer.backend.policy_version == 2 and svc.servicer.registry_info()["delta_base"] == ""
        writer.cleanup()
        client.close()


def test_an_abandoned_delta_stream_stops_its_encoding_threads():
    import gc
    import threading

    def delta_threads() -> set:
        return {t for t in threading.enumerate() if t.name.startswith("weights-delta")}

    gc.collect()  # a stream an earlier test left open is closed as it is collected
    before = delta_threads()  # and any of its threads still ending are not this stream's
    old = _source(torch.float32)
    chunks = encode_weights(_step(old, 1), StreamSpec(2, 1 << 12, "delta", base=old, base_version=1))
    next(chunks), next(chunks)
    assert delta_threads() - before
    chunks.close()
    assert not delta_threads() - before
