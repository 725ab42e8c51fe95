"""Shared-memory weight files (`services.weights.shm`) on real files: what the learner writes
reads back exactly (and is a safetensors file any reader takes); a file that is truncated,
corrupt, of another version, of the wrong shapes or dtypes, not finite, or being rewritten is
refused before a tensor is handed out; pages are recycled only when no reader holds the file;
co-location is proven by the probe file."""

import fcntl
import os

import pytest
import torch

from services.common.rpc.errors import BadRequest
from services.weights import shm

STATE = {
    "big": torch.randn(300, 400),
    "half": torch.randn(70_001).to(torch.bfloat16),
    "ids": torch.arange(5, dtype=torch.int64),
    "empty": torch.zeros(0, 3),
    "flag": torch.tensor(True),
    "odd": torch.randn(3),
}
SPECS = {k: (tuple(t.shape), t.dtype) for k, t in STATE.items()}


@pytest.fixture
def writer(tmp_path):
    w = shm.SharedWeightsWriter(tmp_path, "run-a")
    yield w
    w.cleanup()


def _load(tmp_path, req, specs=SPECS, **kw):
    with shm.open_shared_weights(str(tmp_path), req, specs, **kw) as (policy_version, fmt, state, nbytes, header):
        return policy_version, fmt, {k: v.clone() for k, v in state.items()}, nbytes, header


@pytest.mark.parametrize("digest", ["xxh3_64", "crc32"])
def test_a_written_version_reads_back_exactly_and_is_safetensors(tmp_path, digest):
    w = shm.SharedWeightsWriter(tmp_path, "run-a", digest=digest)
    req = w.write(STATE, 7, epoch=2)
    assert req.file_name == "rlhf-weights-run-a-e2-v7-full.safetensors".replace("run-a", "run_a")
    assert (req.header.policy_version, req.header.run_id, req.header.epoch, req.digest) == (7, "run-a", 2, digest)
    policy_version, fmt, state, nbytes, _ = _load(tmp_path, req)
    assert (policy_version, fmt, nbytes) == (7, "full", sum(t.numel() * t.element_size() for t in STATE.values()))
    assert all(torch.equal(state[k], STATE[k]) and state[k].dtype == STATE[k].dtype for k in STATE)
    from safetensors import safe_open  # vLLM's workers read this layout

    with safe_open(str(tmp_path / req.file_name), framework="pt") as f:
        assert all(torch.equal(f.get_tensor(k), STATE[k]) for k in STATE)
        assert f.metadata()["rlhf.policy_version"] == "7"
    assert sorted(os.listdir(tmp_path)) == [req.file_name]  # nothing half-written left behind


def _tamper(path, offset, data: bytes):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_a_corrupt_or_truncated_file_is_refused(tmp_path, writer):
    req = writer.write(STATE, 1)
    path = tmp_path / req.file_name
    size = path.stat().st_size
    _tamper(path, size - 100, b"\x01")
    with pytest.raises(BadRequest, match="mismatch in 1 piece"):
        _load(tmp_path, req)
    os.truncate(path, size - 4)
    with pytest.raises(BadRequest, match="truncated or replaced"):
        _load(tmp_path, req)
    req.file_bytes = size - 4  # a lying request: the header's offsets no longer fit the file
    with pytest.raises(BadRequest, match="piece checksums|do not fit|end at byte"):
        _load(tmp_path, req)
    _tamper(path, 8, b"{not json")
    req2 = writer.write(STATE, 2)
    _tamper(tmp_path / req2.file_name, 8, b"[")
    with pytest.raises(BadRequest, match="not JSON|header"):
        _load(tmp_path, req2)


def test_wrong_shapes_dtypes_names_and_coverage_are_refused(tmp_path, writer):
    without_odd = {k: v for k, v in STATE.items() if k != "odd"}
    for state, fragment in [
        ({**STATE, "big": torch.randn(400, 300)}, "has shape"),
        ({**STATE, "big": torch.zeros(300, 400, dtype=torch.int32)}, "has dtype"),
        ({**without_odd, "extra": torch.randn(3)}, "unknown tensor"),
        (without_odd, "full version without"),
    ]:
        req = writer.write(state, 1)
        with pytest.raises(BadRequest, match=fragment):
            _load(tmp_path, req)


def test_nan_is_refused(tmp_path, writer):
    bad = {**STATE, "big": STATE["big"].clone()}
    bad["big"][123, 45] = float("nan")
    with pytest.raises(BadRequest, match="'big' contains NaN"):
        _load(tmp_path, writer.write(bad, 1))


def test_another_versions_file_and_the_fence(tmp_path, writer):
    req1 = writer.write(STATE, 1)
    os.link(tmp_path / req1.file_name, tmp_path / "copy")
    req2 = writer.write(STATE, 2)  # recycles version 1's file
    assert writer.recycled == 1 and not (tmp_path / req1.file_name).exists()
    os.replace(tmp_path / "copy", tmp_path / req2.file_name)  # version 2's name, version 2's bytes (same inode)
    req1.file_name = req2.file_name
    with pytest.raises(BadRequest, match="expected"):  # the name must be the header's
        _load(tmp_path, req1)

    def fence(header):
        if header.run_id != "run-b":
            raise BadRequest("weights: push from a writer that is not the run's learner")

    with pytest.raises(BadRequest, match="not the run's learner"):
        _load(tmp_path, req2, on_header=fence)
    stale = shm.SharedWeightsWriter(tmp_path, "run-a").write(STATE, 3, epoch=0)
    stale.header.epoch = 1  # a request that names another epoch than the file's
    stale.file_name = shm.weights_file_name("run-a", 1, 3, "full")
    os.rename(tmp_path / shm.weights_file_name("run-a", 0, 3, "full"), tmp_path / stale.file_name)
    with pytest.raises(BadRequest, match="metadata"):
        _load(tmp_path, stale)


def test_a_file_being_rewritten_is_refused_and_one_being_read_is_not_recycled(tmp_path, writer):
    req1 = writer.write(STATE, 1)
    with shm.open_shared_weights(str(tmp_path), req1, SPECS) as (_, _, state, _, _):
        before = state["big"].clone()
        req2 = writer.write({k: (v + 1 if v.is_floating_point() else v) for k, v in STATE.items()}, 2)
        assert writer.recycled == 0  # held by this reader: a new file, the old one unlinked
        assert writer._maps["full"][0][1] == os.stat(tmp_path / req2.file_name).st_ino  # mapped anew
        assert torch.equal(state["big"], before)  # the reader's mapping is untouched
        assert sorted(os.listdir(tmp_path)) == [req2.file_name]
    fd = os.open(tmp_path / req2.file_name, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as the learner holds it while it writes
        with pytest.raises(BadRequest, match="being rewritten"):
            _load(tmp_path, req2)
    finally:
        os.close(fd)
    assert torch.equal(_load(tmp_path, req2)[2]["big"], STATE["big"] + 1)
    writer.write(STATE, 3, fmt="partial")
    assert len(os.listdir(tmp_path)) == 2  # one file per format at most
    assert writer.cleanup() == 2 and os.listdir(tmp_path) == [] and writer._maps == {}


def test_a_full_volume_is_an_os_error_and_leaves_no_file(tmp_path, writer, monkeypatch):
    """The writer allocates the file's pages before it writes through its mapping: no room is an
    OSError the push falls back from (a write into an unbacked page would be a SIGBUS)."""
    real = os.posix_fallocate

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match="No space"):
        writer.write(STATE, 1)
    assert os.listdir(tmp_path) == [] and writer._maps == {}
    monkeypatch.setattr(os, "posix_fallocate", real)
    req = writer.write(STATE, 2)
    assert torch.equal(_load(tmp_path, req)[2]["big"], STATE["big"])


def test_cleanup_removes_only_this_runs_files(tmp_path):
    a, b = shm.SharedWeightsWriter(tmp_path, "run-a"), shm.SharedWeightsWriter(tmp_path, "run-b")
    a.write(STATE, 1, epoch=1)
    (tmp_path / (shm.FILE_PREFIX + "run_a-e0-full.writing")).write_bytes(b"half")  # a crashed writer's
    kept = b.write(STATE, 1)
    assert shm.SharedWeightsWriter(tmp_path, "run-a").cleanup() == 2
    assert os.listdir(tmp_path) == [kept.file_name]


def test_colocation_needs_the_servers_probe_in_the_same_directory(tmp_path):
    probe = shm.Probe(tmp_path / "shared")
    assert shm.colocated(str(tmp_path / "shared"), probe.nonce)
    assert not shm.colocated(str(tmp_path / "elsewhere"), probe.nonce)
    assert not shm.colocated(str(tmp_path / "shared"), "0" * 32)
    assert not shm.colocated(str(tmp_path / "shared"), "../x")
    assert not shm.colocated(None, probe.nonce)
    probe.close()
    assert not shm.colocated(str(tmp_path / "shared"), probe.nonce)


def test_a_servers_mapping_is_kept_from_version_to_version(tmp_path, writer):
    """The learner writes every version over the same file through the mapping it keeps; a
    server's kept mapping sees each new version (checked against its checksums), and a different
    file replaces it."""
    mappings = shm.Mappings()
    seen, written = [], set()
    for policy_version in range(1, 5):
        state = {k: (v + policy_version if v.is_floating_point() else v) for k, v in STATE.items()}
        req = writer.write(state, policy_version)
        written.add(id(writer._maps["full"][1]))
        with shm.open_shared_weights(str(tmp_path), req, SPECS, mappings=mappings) as (_, _, got, _, _):
            assert all(torch.equal(got[k], state[k]) for k in STATE)
            if not any(m is mappings._maps["full"][1] for m in seen):
                seen.append(mappings._maps["full"][1])
            del got
    assert writer.recycled == 3 and len(seen) == 1 and len(written) == 1
    req = shm.SharedWeightsWriter(tmp_path, "run-b").write(STATE, 9)  # another file: mapped anew
    assert torch.equal(_load(tmp_path, req, mappings=mappings)[2]["big"], STATE["big"])
    assert mappings._maps["full"][1] is not seen[0]
    mappings.close()
