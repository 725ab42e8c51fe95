"""The rollout tests' config and services: the tiny untrained model, a reward server for the
module, and a config per test in a replay namespace of its own (wiped afterwards)."""

import itertools

import pytest

from services.common.config import config_from_dict
from services.common.replay import ReplayStore
from services.reward.server import serve as serve_reward
from tests.grpc_helpers import on_free_ports

GROUP = 2
_ns = itertools.count()


@pytest.fixture(scope="module")
def model_dir(untrained_model_dir):
    return untrained_model_dir


def _cfg(model_dir, url, namespace, reward_port=0, **over):
    # entries the tests register by hand live a minute: they never expire while a test runs
    replay = {
        "url": url,
        "namespace": namespace,
        "block_ms": 50,
        "heartbeat_s": 0.2,
        "heartbeat_ttl_s": 60.0,
        **over.pop("replay", {}),
    }
    d = {
        "model": {"path": model_dir, "device": "cpu"},
        "adv_estimator": "grpo",
        "num_return_sequences_in_group": GROUP,
        "rollout_batch_size": 4,
        "prompt_length": 16,
        "response_length": 4,
        "replay": replay,
        "rollout": {"retries": 2, "retry_backoff_s": 0.05},
        "rpc": {
            "generation": {"port": 0, "metrics_port": None},
            "reward": {"port": reward_port, "metrics_port": None, "http_port": None},
            "critic": {"port": 0, "metrics_port": None},
        },
    }
    d.update(over)
    return config_from_dict(d)


@pytest.fixture(scope="module")
def reward_port(model_dir):
    cfg = _cfg(model_dir, None, "unused")
    with serve_reward(on_free_ports(cfg, "reward")) as svc:
        yield svc.server.port


@pytest.fixture
def make_cfg(model_dir, redis_server, reward_port):
    """cfg(**overrides) in this test's own namespace; every namespace used is wiped afterwards."""
    namespace = f"rollout{next(_ns)}"

    def make(url=redis_server.url, **over):
        return _cfg(model_dir, url, namespace, reward_port, **over)

    yield make
    ReplayStore.from_config(make()).reset()


@pytest.fixture
def local_session_cfg(tiny_model_dir, monkeypatch):
    """`local_session_cfg(rollout=..., **overrides)`: the small GRPO `train --local` config the
    session tests run (4 prompts x 2 sessions, 2 iterations, the held-out eval every iteration),
    with starting a generation server made an error: in one process a session samples through
    the backend, never a server."""
    import services.generation.server as generation_server

    def no_server(*args, **kwargs):
        raise AssertionError("train --local started a generation server")

    monkeypatch.setattr(generation_server, "serve", no_server)

    def make(**over):
        d = {
            "model": {"path": tiny_model_dir, "device": "cpu"},
            "adv_estimator": "grpo",
            "num_return_sequences_in_group": 2,
            "rollout_batch_size": 4,
            "ppo_mini_batch_size": 8,
            "data": {"train": "synthetic:reverse", "eval": "synthetic:reverse", "eval_size": 3},
            "run": {"iterations": 2, "eval_interval": 1, "checkpoint_interval": 0, "seed": 0},
            **over,
        }
        return config_from_dict(d)

    return make
