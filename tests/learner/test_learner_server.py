"""The learner service's lifecycle on real servers: it reports ready on the gRPC health service
once it has resumed and published the current policy (probes depend on it), serves PullWeights
as a stream the interceptor accounts for, and drains to a checkpoint."""

import threading
import time

import pytest

from services.common.config import config_from_dict
from services.common.rpc import health
from services.generation.server import serve as serve_generation
from services.learner.server import serve as serve_learner
from services.reward.server import serve as serve_reward
from services.weights.pull import LearnerClient
from tests.grpc_helpers import on_free_ports


@pytest.fixture
def cfg(tiny_model_dir, redis_server, tmp_path):
    return config_from_dict(
        {
            "model": {"path": tiny_model_dir, "device": "cpu"},
            "adv_estimator": "grpo",
            "num_return_sequences_in_group": 2,
            "rollout_batch_size": 4,
            "prompt_length": 16,
            "response_length": 4,
            "ppo_mini_batch_size": 8,
            "data": {"eval_size": 4},
            "replay": {"url": redis_server.url, "namespace": "lifecycle", "block_ms": 50, "heartbeat_s": 0.2},
            "run": {"iterations": 3, "run_dir": str(tmp_path / "run")},
            "rpc": {"learner": {"port": 0, "metrics_port": None, "http_port": None}},
        }
    )


def test_learner_reports_ready_serves_pulls_and_drains(cfg):
    with serve_reward(on_free_ports(cfg, "reward")) as reward:
        cfg.rpc.reward.port = reward.server.port
        with serve_generation(on_free_ports(cfg, "generation")), serve_learner(cfg) as learner:
            address = f"127.0.0.1:{learner.server.port}"
            assert health.status(address, "", timeout_s=30) == "SERVING"  # alive
            # not ready before it has resumed
            assert health.status(address, "rlhf.v1.Learner", timeout_s=30) == "NOT_SERVING"
            result = {}
            loop = threading.Thread(target=lambda: result.setdefault("code", learner.run()))
            loop.start()
            deadline = time.time() + 180
            while not health.check(address, "rlhf.v1.Learner", timeout_s=30) and time.time() < deadline:
                time.sleep(0.1)
            assert learner.ready and health.status(address, "rlhf.v1.Learner", timeout_s=30) == "SERVING"
            client = LearnerClient(address, cfg.rpc)
            chunks = list(client.pull_weights(-1))
            assert chunks and chunks[0].WhichOneof("payload") == "header" and chunks[0].header.policy_version == 0
            assert list(client.pull_weights(0)) == []  # already current
            samples = learner.server.metrics.registry.get_sample_value
            assert (
                samples("rlhf_rpc_requests_total", {"service": "learner", "method": "PullWeights", "code": "OK"}) == 2
            )
            # no worker runs: the learner waits for trajectories until drained, then checkpoints
            while learner.loop.state != "waiting" and time.time() < deadline:
                time.sleep(0.1)
            learner.drain()
            loop.join(timeout=180)
            assert result == {"code": 0} and learner.loop.state == "stopped"
            assert learner.loop.checkpointer.latest() is not None
