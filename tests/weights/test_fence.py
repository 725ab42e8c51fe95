"""Version fencing: a generation server in a distributed run (replay.url set) applies weights only
from the run's learner, as the replay registry names it (run id, epoch, version counter); pushes
and pulls alike. A real server on a loopback port and a real Redis."""

import copy
import itertools
import socket
import threading

import grpc
import pytest
import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.common.config import config_from_dict
from services.common.replay import ReplayStore
from services.common.rpc.gen import learner_pb2_grpc
from services.common.rpc.server import RPCServer
from services.generation.client import GenerationClient
from services.generation.registration import Registration
from services.generation.server import serve
from services.weights.receiver import LearnerFence
from services.weights.stream import StreamSpec, weight_chunks
from tests.grpc_helpers import expect_code, on_free_ports

NOT_THE_LEARNER = "push from a writer that is not the run's learner"
_ns = itertools.count()


@pytest.fixture(scope="module")
def fenced(cfg, redis_server):
    c = config_from_dict(
        {**cfg.model_dump(), "replay": {"url": redis_server.url, "namespace": "fence", "heartbeat_s": 60}}
    )
    store = ReplayStore.from_config(c)
    store.reset()
    with serve(on_free_ports(c, "generation")) as svc:
        client = GenerationClient(f"127.0.0.1:{svc.server.port}", c.rpc)
        yield svc.servicer, store, client, c
        client.close()
    store.reset()


def _learner_starts(store, run_id="run-a", policy_version=None):
    """What a learner does when it starts: a new epoch, published with its run id."""
    epoch = store.new_learner_epoch()
    store.publish_learner(
        "127.0.0.1:1", store.version() if policy_version is None else policy_version, run_id=run_id, epoch=epoch
    )
    return epoch


def _state(servicer, shift=0.0):
    return {k: t + shift for k, t in servicer.backend.model.state_dict().items()}


def test_only_the_runs_learner_may_push(fenced):
    servicer, store, client, _ = fenced
    v = client.policy_version
    state = _state(servicer, 0.01)
    store.r.delete(store.learner_key)  # no learner yet
    expect_code(
        lambda: client.update_weights(state, v + 1, run_id="run-a", epoch=1),
        grpc.StatusCode.INVALID_ARGUMENT,
        "no learner has registered",
    )
    epoch = _learner_starts(store)
    store.raise_version_to(v + 1)  # the learner raises the counter before it pushes
    for run_id, ep, policy_version, why in [
        ("run-b", epoch, v + 1, "the learner registered in 'fence' has run_id='run-a'"),
        ("run-a", epoch - 1, v + 1, f"epoch={epoch})"),
        ("", 0, v + 1, "run_id='', epoch=0"),
        ("run-a", epoch, v + 2, f"version {v + 2} is above the run's version counter"),
        ("run-a", epoch, 2**63 - 1, "above the run's version counter"),
    ]:
        details = expect_code(
            lambda: client.update_weights(state, policy_version, run_id=run_id, epoch=ep),
            grpc.StatusCode.INVALID_ARGUMENT,
            why,
        )
        assert NOT_THE_LEARNER in details
    assert client.policy_version == v
    # the run's learner: applied (a refused push at 2^63-1 did not lock the run)
    assert client.update_weights(state, v + 1, run_id="run-a", epoch=epoch).policy_version == v + 1
    # the learner restarts: the old process's pushes are refused from now on
    new_epoch = _learner_starts(store)
    store.raise_version_to(v + 2)
    expect_code(
        lambda: client.update_weights(state, v + 2, run_id="run-a", epoch=epoch),
        grpc.StatusCode.INVALID_ARGUMENT,
        NOT_THE_LEARNER,
    )
    assert client.update_weights(state, v + 2, run_id="run-a", epoch=new_epoch).policy_version == v + 2
    # versions still only move forward
    expect_code(
        lambda: client.update_weights(state, v + 2, run_id="run-a", epoch=new_epoch),
        grpc.StatusCode.INVALID_ARGUMENT,
        "not newer",
    )


def test_the_header_is_checked_before_the_pieces_are_read(fenced):
    servicer, store, client, _ = fenced
    epoch = _learner_starts(store)
    v = client.policy_version
    store.raise_version_to(v + 1)
    chunks = list(weight_chunks(_state(servicer), StreamSpec(v + 1, run_id="run-a", epoch=epoch - 1)))
    chunks[1].piece.data = b"garbage"  # never read: the header is refused first
    expect_code(
        lambda: client.stub.PushWeights(iter(chunks), metadata=client.metadata),
        grpc.StatusCode.INVALID_ARGUMENT,
        NOT_THE_LEARNER,
    )


def test_a_learner_that_takes_over_during_a_push_wins(fenced, monkeypatch):
    """Checked again right before the swap: a push whose writer lost the run while its pieces were
    on the way is not applied."""
    servicer, store, client, _ = fenced
    epoch = _learner_starts(store)
    v = client.policy_version
    store.raise_version_to(v + 1)
    header_checked = threading.Event()
    real = servicer.fence

    def fence(header):
        real(header)
        header_checked.set()

    monkeypatch.setattr(servicer, "fence", fence)

    def stream():
        chunks = weight_chunks(_state(servicer, 0.02), StreamSpec(v + 1, run_id="run-a", epoch=epoch))
        yield next(chunks)
        assert header_checked.wait(120)
        _learner_starts(store)  # a new learner process starts while the old one still pushes
        yield from chunks

    expect_code(
        lambda: client.stub.PushWeights(stream(), metadata=client.metadata),
        grpc.StatusCode.INVALID_ARGUMENT,
        NOT_THE_LEARNER,
    )
    assert client.policy_version == v


def test_registry_unreachable_is_unavailable(fenced, monkeypatch):
    servicer, store, client, _ = fenced
    epoch = _learner_starts(store)
    v = client.policy_version
    store.raise_version_to(v + 1)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    dead = copy.copy(store)
    dead.r = redis.Redis(host="127.0.0.1", port=dead_port, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
    monkeypatch.setattr(servicer, "fence", LearnerFence(dead))
    expect_code(
        lambda: client.update_weights(_state(servicer), v + 1, run_id="run-a", epoch=epoch),
        grpc.StatusCode.UNAVAILABLE,
        "the replay registry cannot be reached",
    )
    assert client.policy_version == v


class _FakeLearner(learner_pb2_grpc.LearnerServicer):
    def __init__(self):
        self.policy_version, self.state, self.run_id, self.epoch = 0, {}, "", 0

    def PullWeights(self, request, context):
        if request.have_policy_version < self.policy_version:
            yield from weight_chunks(self.state, StreamSpec(self.policy_version, run_id=self.run_id, epoch=self.epoch))


def test_pulls_from_the_learner_pass_the_same_fence(fenced):
    servicer, store, client, cfg = fenced
    learner = _FakeLearner()
    server = RPCServer("learner", cfg.rpc, port=0, host="127.0.0.1")
    learner_pb2_grpc.add_LearnerServicer_to_server(learner, server.grpc)
    server.start()
    try:
        v = client.policy_version
        epoch = store.new_learner_epoch()
        store.raise_version_to(v + 1)
        store.publish_learner(f"127.0.0.1:{server.port}", v + 1, run_id="run-a", epoch=epoch)
        reg = Registration(cfg, servicer, "127.0.0.1:0", store)
        learner.policy_version, learner.state = v + 1, _state(servicer, 0.03)
        learner.run_id, learner.epoch = "run-a", epoch - 1  # an older learner process serves it
        assert reg.sync() is False and client.policy_version == v
        learner.epoch = epoch
        assert reg.sync() is True and client.policy_version == v + 1
        for k, t in servicer.backend.model.state_dict().items():
            assert torch.equal(t, learner.state[k])
    finally:
        server.stop(0)
