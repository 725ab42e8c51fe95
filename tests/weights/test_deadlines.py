"""Every phase of a weight push has a deadline, and when one passes both sides say which phase
and which peer: the learner ('weight push v3 to 127.0.0.1:PORT: phase=apply timed out after 8 s
(deadline 8 s)') and the generation server ('weight update v3 (stream) from ipv4:...: phase=swap
timed out ...'). A swap that had not started when the deadline passed (the running batch still
decoding) is withdrawn: the server keeps serving the version it had, and pulls the new one when
it finds itself behind. A registry that does not answer after a push is logged with its phase."""

import logging
import threading
import time
from types import SimpleNamespace

import grpc
import pytest
import redis
import torch

from services.common.config import config_from_dict
from services.common.types import SamplingParams
from services.generation.backend import HFBackend
from services.generation.client import GenerationClient
from services.generation.server import serve
from tests.grpc_helpers import closed, expect_code, held_backend, on_free_ports, publisher

# long enough for the stream and its checks of the tiny model on a busy machine (tens of ms idle),
# so the deadline passes where the test holds the push: at the swap, or behind an earlier update
DEADLINE_S = 8.0


@pytest.fixture
def short_cfg(cfg):
    return config_from_dict({**cfg.model_dump(), "rpc": {**cfg.rpc.model_dump(), "timeout_s": DEADLINE_S}})


@pytest.fixture
def busy_server(short_cfg, tiny_model_dir):
    """A generation server whose batch decodes until released (`release`): a swap waits for it."""
    backend, started, release = held_backend(tiny_model_dir, 60)
    with serve(on_free_ports(short_cfg, "generation"), backend=backend) as svc:
        client = GenerationClient(f"127.0.0.1:{svc.server.port}", short_cfg.rpc, timeout_s=60)
        t = threading.Thread(target=client.generate, args=([[1, 4, 5]], SamplingParams(max_new_tokens=2)))
        t.start()
        assert started.wait(120)
        try:
            yield svc, backend, release
        finally:
            release.set()
            t.join(60)
            client.close()


def _publisher(cfg, address, state, beats):
    store = SimpleNamespace(
        live=lambda kind: {address: {}},
        publish_learner=lambda *a: None,
        heartbeat=lambda kind, addr, **f: beats.append((addr, f["policy_version"])),
    )
    learner = SimpleNamespace(policy_state_dict=lambda: state, device=torch.device("cpu"), lora=False)
    return publisher(cfg, store, learner)


def test_a_push_whose_swap_waits_past_the_deadline_names_the_phase_and_the_peer(short_cfg, busy_server, caplog):
    svc, backend, release = busy_server
    address = f"127.0.0.1:{svc.server.port}"
    state = {k: v.clone() + 0.01 for k, v in backend.model.state_dict().items()}
    beats = []
    bc = _publisher(short_cfg, address, state, beats)
    caplog.set_level(logging.WARNING)
    try:
        out = bc.push(3, "learner:1")
    finally:
        closed(bc)
    assert out["push/servers"] == 1 and out["push/failed"] == 1 and beats == []
    learner_side = [r.getMessage() for r in caplog.records if r.name == "services.weights.publisher"]
    assert any(
        m.startswith(f"weight push v3 to {address}: phase=apply timed out after")
        and f"(deadline {DEADLINE_S:g} s)" in m
        and "DEADLINE_EXCEEDED" in m
        for m in learner_side
    ), learner_side

    def server_said():  # the server's own wait ends with the same deadline, a moment apart
        return [
            m
            for m in (r.getMessage() for r in caplog.records if r.name == "services.weights.receiver")
            if "weight update v3 (stream) from ipv4:127.0.0.1:" in m
            and "phase=swap timed out after" in m
            and "not applied" in m
        ]

    deadline = time.monotonic() + 60
    while not server_said() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server_said(), [r.getMessage() for r in caplog.records]
    release.set()
    # the withdrawn swap never ran: the server still serves what it had, and takes the next push
    assert backend.policy_version == 0
    bc = _publisher(
        short_cfg.model_copy(update={"rpc": short_cfg.rpc.model_copy(update={"timeout_s": 30})}), address, state, beats
    )
    try:
        assert bc.push(4, "learner:1")["push/failed"] == 0
    finally:
        closed(bc)
    assert backend.policy_version == 4 and beats == [(address, 4)]


def test_a_push_waiting_for_an_earlier_update_names_that_phase(short_cfg, busy_server, caplog):
    svc, backend, release = busy_server
    state = {k: v.clone() for k, v in backend.model.state_dict().items()}
    caplog.set_level(logging.WARNING)

    def server_said():
        return [
            m
            for m in (r.getMessage() for r in caplog.records if r.name == "services.weights.receiver")
            if "weight update (stream) from ipv4:127.0.0.1:" in m and "phase=wait-for-previous-update timed out" in m
        ]

    svc.servicer.receiver.lock.acquire()  # an earlier update holds the server (until the server gave up)
    try:
        client = GenerationClient(f"127.0.0.1:{svc.server.port}", short_cfg.rpc)
        expect_code(lambda: client.update_weights(state, 5), grpc.StatusCode.DEADLINE_EXCEEDED)
        client.close()
        deadline = time.monotonic() + 60
        while not server_said() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        svc.servicer.receiver.lock.release()
    assert server_said(), [r.getMessage() for r in caplog.records]
    assert backend.policy_version == 0


def test_a_registry_that_does_not_answer_after_a_push_is_logged_with_its_phase(cfg, tiny_model_dir, caplog):
    with serve(on_free_ports(cfg, "generation"), backend=HFBackend(tiny_model_dir, "cpu")) as svc:
        address = f"127.0.0.1:{svc.server.port}"
        state = {k: v.clone() for k, v in svc.servicer.backend.model.state_dict().items()}

        def silent(*a, **kw):
            raise redis.exceptions.TimeoutError(
                "replay store heartbeat on redis 10.0.0.7:6379: Timeout reading from 10.0.0.7:6379"
            )

        bc = _publisher(cfg, address, state, [])
        bc.store.heartbeat = silent
        caplog.set_level(logging.WARNING)
        try:
            out = bc.push(2, "learner:1")
        finally:
            closed(bc)
        assert out["push/failed"] == 0 and svc.servicer.backend.policy_version == 2  # the server took it
        assert any(
            r.getMessage().startswith(f"weight push v2 to {address}: phase=register timed out after")
            and "10.0.0.7:6379" in r.getMessage()
            for r in caplog.records
        )
