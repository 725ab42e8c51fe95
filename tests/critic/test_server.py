import grpc
import pytest
import torch

from services.common.modeling import build_token_batch
from services.common.rpc.codec import batch_to_proto, tensor_to_proto
from services.common.rpc.gen import critic_pb2 as cpb
from services.critic.client import CriticClient
from services.critic.critic import Critic
from services.critic.server import serve

from tests.grpc_helpers import expect_code


@pytest.fixture(scope="module")
def server(cfg):
    with serve(cfg, port=0, metrics_port=None) as svc:
        yield svc.server


def _batch():
    return build_token_batch([[1, 4, 5, 30], [1, 6, 30]], [[5, 4, 2], [6]], 0)


def test_values_train_save_load_match_in_process(server, cfg, tmp_path):
    c = CriticClient(f"127.0.0.1:{server.port}", cfg.rpc)
    local = Critic.from_config(cfg)
    b = _batch()
    assert torch.allclose(c.values(b), local.values(b), atol=1e-6)
    returns = b.response_mask * 2.0
    m_remote = c.train_step(b, returns, c.values(b))
    m_local = local.train_step(b, returns, local.values(b))
    assert m_remote["critic/vf_loss"] == pytest.approx(m_local["critic/vf_loss"], rel=1e-5)
    assert torch.allclose(c.values(b), local.values(b), atol=1e-5)
    assert c.save(tmp_path / "ck") == 1
    c.train_step(b, returns, c.values(b))
    assert c.load(tmp_path / "ck") == 1
    assert torch.allclose(c.values(b), local.values(b), atol=1e-5)


def test_bad_critic_input(server, cfg, tmp_path):
    c = CriticClient(f"127.0.0.1:{server.port}", cfg.rpc)
    b = _batch()
    call = lambda req: c.stub.Train(req, metadata=c.metadata)  # noqa: E731
    nan = b.response_mask.clone()
    nan[0, 0] = float("nan")
    expect_code(lambda: call(cpb.TrainRequest(batch=batch_to_proto(b), returns=tensor_to_proto(nan),
                                              old_values=tensor_to_proto(b.response_mask))),
                grpc.StatusCode.INVALID_ARGUMENT, "returns: contains NaN")
    expect_code(lambda: call(cpb.TrainRequest(batch=batch_to_proto(b), returns=tensor_to_proto(torch.zeros(2, 5)),
                                              old_values=tensor_to_proto(b.response_mask))),
                grpc.StatusCode.INVALID_ARGUMENT, "returns: shape [2, 5], expected [2, 3]")
    big = build_token_batch([[1, 99999]], [[4]], 0)
    expect_code(lambda: c.stub.Values(cpb.ValuesRequest(batch=batch_to_proto(big)), metadata=c.metadata),
                grpc.StatusCode.INVALID_ARGUMENT, "token id 99999 outside the vocabulary")
    long = build_token_batch([[1] * 40], [[4]], 0)
    expect_code(lambda: c.stub.Values(cpb.ValuesRequest(batch=batch_to_proto(long)), metadata=c.metadata),
                grpc.StatusCode.INVALID_ARGUMENT, "prompt_length=32")
    expect_code(lambda: c.stub.Values(cpb.ValuesRequest(), metadata=c.metadata), grpc.StatusCode.INVALID_ARGUMENT,
                "batch.input_ids: missing")
    expect_code(lambda: c.load(tmp_path / "none"), grpc.StatusCode.INVALID_ARGUMENT, "no critic checkpoint")
    assert c.values(b).shape == (2, 3)  # still serving
