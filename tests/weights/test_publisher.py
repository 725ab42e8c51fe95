"""The shared-memory push on real gRPC servers (loopback) and real files: co-located servers load
the version from shared memory, a server whose probe is elsewhere gets the stream; bad files are
refused with nothing applied; a refused load is retried over gRPC; a server killed mid-push fails
alone; the learner's files are bounded and removed."""

import errno
import os
import threading
import time
from types import SimpleNamespace

import grpc
import pytest
import torch

from services.common.rpc.errors import BadRequest
from services.generation.backend import HFBackend
from services.generation.client import GenerationClient
from services.generation.server import serve
from services.weights import shm
from tests.grpc_helpers import closed, expect_code, on_free_ports, publisher


def with_shm(cfg, directory):
    return cfg.model_copy(update={"rpc": cfg.rpc.model_copy(update={"shm_dir": str(directory), "timeout_s": 20})})


class Registry:
    """The replay registry as the publisher reads it: each server's entry as its `Registration`
    heartbeats it (`registry_info`), and the learner's own heartbeats after a push."""

    def __init__(self, services):
        self.services, self.beats = list(services), []

    def live(self, kind):
        return {
            f"127.0.0.1:{s.server.port}": {
                "policy_version": s.servicer.backend.policy_version,
                **s.servicer.registry_info(),
            }
            for s in self.services
        }

    def heartbeat(self, kind, address, **info):
        self.beats.append((address, info))

    def publish_learner(self, *args):
        pass


def _server(cfg, tiny_model_dir):
    return serve(on_free_ports(cfg, "generation"), backend=HFBackend(tiny_model_dir, "cpu"))


def _state(svc, shift):
    return {k: v + shift for k, v in svc.servicer.backend.model.state_dict().items()}


def _serves(svc, state) -> bool:
    got = svc.servicer.backend.model.state_dict()
    return all(torch.equal(got[k], state[k]) for k in state)


def _publisher(cfg, services, state):
    learner = SimpleNamespace(policy_state_dict=lambda: state, device=torch.device("cpu"), lora=False)
    bc = publisher(cfg, Registry(services), learner)
    bc.identity = ("run-a", 1)
    return bc


def _weight_files(directory):
    return sorted(p for p in os.listdir(directory) if p.startswith(shm.FILE_PREFIX))


def test_colocated_servers_load_from_shared_memory_and_a_remote_one_gets_the_stream(cfg, tiny_model_dir, tmp_path):
    local, remote = with_shm(cfg, tmp_path / "shm"), with_shm(cfg, tmp_path / "other-host")
    with _server(local, tiny_model_dir) as a, _server(local, tiny_model_dir) as b, _server(remote, tiny_model_dir) as c:
        state = _state(a, 0.01)
        bc = _publisher(local, [a, b, c], state)
        try:
            out = bc.push(1, "learner:1")
            assert (out["push/servers"], out["push/failed"], out["push/shm"]) == (3, 0, 2)
            assert all(s.servicer.backend.policy_version == 1 and _serves(s, state) for s in (a, b, c))
            assert len(_weight_files(tmp_path / "shm")) == 1  # written once for both
            for i in range(2, 5):  # every later version recycles the same file
                state = {k: v + 0.01 for k, v in state.items()}
                bc.learner.policy_state_dict = lambda state=state: state
                assert bc.push(i, "learner:1")["push/shm"] == 2
                assert _serves(a, state) and _serves(c, state)
            assert bc.shared.writer.recycled == 3 and len(_weight_files(tmp_path / "shm")) == 1
            client = GenerationClient(f"127.0.0.1:{a.server.port}", local.rpc)
            from services.common.types import SamplingParams

            assert client.generate([[1, 4, 5]], SamplingParams(max_new_tokens=4, temperature=0)).policy_version == 4
            client.close()
            # the learner's heartbeat keeps what the server advertised (its probe, its base)
            address, info = bc.store.beats[-1]
            assert info["policy_version"] == 4 and info["base"] == "run:run-a" and "shm" in info
        finally:
            closed(bc)
        assert _weight_files(tmp_path / "shm") == []
    assert os.listdir(tmp_path / "shm") == []  # the servers' probes go with them


def test_bad_shared_files_are_refused_and_the_old_weights_keep_serving(cfg, tiny_model_dir, tmp_path):
    local = with_shm(cfg, tmp_path)
    with _server(local, tiny_model_dir) as svc:
        client = GenerationClient(f"127.0.0.1:{svc.server.port}", local.rpc)
        before = _state(svc, 0.0)
        writer = shm.SharedWeightsWriter(tmp_path, "run-a")

        def refused(state, policy_version, fragment, tamper=None, **kw):
            req = writer.write(state, policy_version, **kw)
            if tamper:
                tamper(tmp_path / req.file_name, req)
            expect_code(lambda: client.load_shared(req), grpc.StatusCode.INVALID_ARGUMENT, fragment)
            assert svc.servicer.backend.policy_version == 0 and _serves(svc, before)

        def flip(path, req):
            with open(path, "r+b") as f:
                f.seek(req.file_bytes // 2)
                byte = f.read(1)
                f.seek(req.file_bytes // 2)
                f.write(bytes([byte[0] ^ 0xFF]))

        good = _state(svc, 0.02)
        refused(good, 1, "mismatch", flip)
        refused(good, 1, "truncated", lambda path, req: os.truncate(path, req.file_bytes - 1))
        name = next(iter(good))
        refused({**good, name: good[name].double()}, 1, "total_bytes")
        refused({**good, name: good[name].reshape(-1)}, 1, "has shape")
        nan = {**good, name: good[name].clone()}
        nan[name].view(-1)[0] = float("nan")
        refused(nan, 1, "NaN")
        refused(good, 0, "not newer")

        def fence(header):
            if header.run_id != "run-b":
                raise BadRequest("weights: push from a writer that is not the run's learner")

        svc.servicer.fence = fence
        refused(good, 1, "not the run's learner")
        svc.servicer.fence = None
        req = writer.write(good, 1)
        client.load_shared(req)
        assert svc.servicer.backend.policy_version == 1 and _serves(svc, good)
        writer.cleanup()
        client.close()


def test_a_refused_shared_load_is_streamed_and_a_write_failure_too(cfg, tiny_model_dir, tmp_path, monkeypatch):
    local = with_shm(cfg, tmp_path)
    with _server(local, tiny_model_dir) as a, _server(local, tiny_model_dir) as b:
        state = _state(a, 0.03)
        bc = _publisher(local, [a, b], state)

        def refuse(request):
            raise BadRequest("shm: simulated refusal")

        monkeypatch.setattr(b.servicer, "apply_shared", refuse)
        try:
            out = bc.push(1, "learner:1")
            assert (out["push/failed"], out["push/shm"]) == (0, 1)  # a from shared memory, b over gRPC
            assert _serves(a, state) and _serves(b, state) and b.servicer.backend.policy_version == 1

            def full(*args, **kw):
                raise OSError(errno.ENOSPC, "No space left on device")

            monkeypatch.setattr(shm.SharedWeightsWriter, "write", full)
            out = bc.push(2, "learner:1")
            assert (out["push/failed"], out["push/shm"]) == (0, 0)
            assert a.servicer.backend.policy_version == b.servicer.backend.policy_version == 2
        finally:
            closed(bc)


def test_a_server_killed_mid_push_fails_alone(cfg, tiny_model_dir, tmp_path, monkeypatch):
    local = with_shm(cfg, tmp_path)
    with _server(local, tiny_model_dir) as a, _server(local, tiny_model_dir) as b, _server(local, tiny_model_dir) as c:
        state = _state(a, 0.04)
        bc = _publisher(local, [a, b, c], state)
        entered, release = threading.Event(), threading.Event()
        swap = c.servicer.backend.update_weights

        def stuck(*args):
            entered.set()
            release.wait(120)
            return swap(*args)

        monkeypatch.setattr(c.servicer.backend, "update_weights", stuck)

        def kill():
            entered.wait(120)
            c.server.grpc.stop(0)  # gone mid-swap: its in-flight load and any retry fail
            time.sleep(0.2)
            release.set()

        killer = threading.Thread(target=kill)
        killer.start()
        try:
            out = bc.push(1, "learner:1")
        finally:
            killer.join()
            closed(bc)
        assert (out["push/servers"], out["push/failed"]) == (3, 1)
        assert a.servicer.backend.policy_version == b.servicer.backend.policy_version == 1
        assert _serves(a, state) and _serves(b, state)
    assert _weight_files(tmp_path) == []


def test_a_server_without_shm_dir_refuses_a_shared_load(cfg, tiny_model_dir, tmp_path):
    with _server(cfg, tiny_model_dir) as svc:
        req = shm.SharedWeightsWriter(tmp_path, "run-a").write(_state(svc, 0.01), 1)
        client = GenerationClient(f"127.0.0.1:{svc.server.port}", cfg.rpc)
        expect_code(lambda: client.load_shared(req), grpc.StatusCode.INVALID_ARGUMENT, "no shared-memory directory")
        client.close()
        assert "shm" not in svc.servicer.registry_info()


@pytest.mark.parametrize("bad_dir", ["/proc/rlhf-shm"])
def test_an_unusable_shm_dir_only_turns_the_fast_path_off(cfg, tiny_model_dir, bad_dir):
    with _server(with_shm(cfg, bad_dir), tiny_model_dir) as svc:
        assert svc.servicer.probe is None and "shm" not in svc.servicer.registry_info()
