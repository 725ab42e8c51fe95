"""ScoreTokens (the learner's push parity check asks it): a real generation server on a loopback
port scores given tokens under the version it serves, teacher-forced, equal to a plain forward of
the same model on the same tokens; it runs on the compute thread between batches, names the
version it scored with, keeps Generate's auth and limits, and a backend that cannot score answers
UNIMPLEMENTED; the vLLM backend scores with its prompt log-probs."""

import threading

import grpc
import pytest
import torch

from services.common.model_files import load_causal_lm
from services.common.rpc.errors import Reason, details_of, reason_of
from services.common.rpc.gen import generation_pb2 as gpb
from services.generation.backend import HFBackend
from services.generation.client import GenerationClient
from services.generation.server import serve
from tests.generation.test_server import backend_cfg, tied
from tests.grpc_helpers import expect_code, on_free_ports

SEQS = [[1, 4, 5, 6, 30, 7, 8, 9], [1, 12, 13], [1, 20, 21, 22, 23, 24, 25, 26, 27, 28]]
STARTS = [3, 1, 6]


def plain_log_probs(model, ids, start):
    """log p(ids[t] | ids[:t]) for t >= start from a plain forward's full logits."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)[start - 1 : -1].gather(-1, torch.tensor(ids[start:])[:, None])[:, 0]


@pytest.fixture(scope="module")
def served(cfg, tiny_model_dir):
    with serve(on_free_ports(cfg, "generation"), backend=HFBackend(tiny_model_dir, "cpu")) as svc:
        client = GenerationClient(f"127.0.0.1:{svc.server.port}", cfg.rpc)
        yield svc, client
        client.close()


def test_scores_equal_a_plain_forward_of_the_same_model(served, tiny_model_dir):
    svc, client = served
    model = load_causal_lm(tiny_model_dir).eval()
    got = client.score_tokens(SEQS, STARTS)
    assert got.policy_version == svc.servicer.backend.policy_version == 0 and got.dtype == "float32"
    assert [len(lp) for lp in got.log_probs] == [len(s) - st for s, st in zip(SEQS, STARTS)]
    for ids, start, lp in zip(SEQS, STARTS, got.log_probs):
        assert torch.allclose(torch.tensor(lp), plain_log_probs(model, ids, start), atol=1e-5)


def test_scores_come_from_the_version_pushed_and_name_it(served, tiny_model_dir):
    svc, client = served
    model = load_causal_lm(tiny_model_dir).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    version = svc.servicer.backend.policy_version + 1
    client.update_weights(tied(model.state_dict()), version)
    got = client.score_tokens(SEQS[:1], STARTS[:1])
    assert got.policy_version == version
    assert torch.allclose(torch.tensor(got.log_probs[0]), plain_log_probs(model, SEQS[0], STARTS[0]), atol=1e-5)


def test_it_runs_on_the_compute_thread_between_batches(served, monkeypatch):
    svc, client = served
    threads = []
    real = svc.servicer.backend.score

    def score(*a):
        threads.append(threading.current_thread().name)
        return real(*a)

    monkeypatch.setattr(svc.servicer.backend, "score", score)
    client.score_tokens(SEQS[:1], STARTS[:1])
    assert threads == ["generation-batcher"]  # the thread that runs every batch and weight swap


def test_a_bfloat16_engine_says_so_and_stays_close(cfg, tiny_model_dir):
    model = load_causal_lm(tiny_model_dir).eval()
    with serve(on_free_ports(cfg, "generation"), backend=HFBackend(tiny_model_dir, "cpu", torch.bfloat16)) as svc:
        client = GenerationClient(f"127.0.0.1:{svc.server.port}", cfg.rpc)
        got = client.score_tokens(SEQS, STARTS)
        client.close()
    assert got.dtype == "bfloat16"
    diff = torch.cat(
        [torch.tensor(lp) - plain_log_probs(model, s, st) for s, st, lp in zip(SEQS, STARTS, got.log_probs)]
    )
    assert 0 < diff.abs().mean() < 0.05  # bfloat16's rounding, not another policy


def _request(seqs, starts):
    return gpb.ScoreTokensRequest(
        sequences=[gpb.ScoredSequence(token_ids=s, prompt_tokens=st) for s, st in zip(seqs, starts)]
    )


def test_bad_requests_are_refused_with_their_field(served, cfg):
    _, client = served
    stub, md = client.stub, client.metadata
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    expect_code(lambda: stub.ScoreTokens(_request([], []), metadata=md), invalid, "empty batch")
    for seqs, starts, field in (
        ([[1, 4, 5]], [0], "sequences[0].prompt_tokens"),  # no context
        ([[1, 4, 5]], [3], "sequences[0].prompt_tokens"),  # nothing to score
        ([[1, 4], [1, 10**6]], [1, 1], "sequences[1].token_ids"),  # outside the vocabulary
        ([[1] * 41], [1], "sequences[0]"),  # longer than prompt_length + response_length (40)
    ):
        with pytest.raises(grpc.RpcError) as e:
            stub.ScoreTokens(_request(seqs, starts), metadata=md)
        assert e.value.code() == invalid, e.value.details()
        assert [v.field for v in details_of(e.value).violations] == [field]
    many = [[1, 4]] * (cfg.rpc.max_prompts_per_request + 1)
    expect_code(lambda: stub.ScoreTokens(_request(many, [1] * len(many)), metadata=md), invalid, "more than")
    expect_code(lambda: stub.ScoreTokens(_request(SEQS, STARTS)), grpc.StatusCode.UNAUTHENTICATED)


def test_a_request_beyond_max_request_tokens_is_too_large(cfg, tiny_model_dir):
    small = on_free_ports(cfg, "generation")
    small.rpc.max_request_tokens = 16
    with serve(small, backend=HFBackend(tiny_model_dir, "cpu")) as svc:
        client = GenerationClient(f"127.0.0.1:{svc.server.port}", cfg.rpc)
        with pytest.raises(grpc.RpcError) as e:
            client.score_tokens(SEQS, STARTS)  # 21 tokens
        client.close()
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert reason_of(e.value) is Reason.REQUEST_TOO_LARGE


def test_a_backend_that_cannot_score_answers_unimplemented(served, monkeypatch):
    """A backend whose `scores_tokens` is false (vLLM's) is refused; the learner's check then skips the server."""
    svc, client = served
    monkeypatch.setattr(svc.servicer.backend, "scores_tokens", False)
    expect_code(lambda: client.score_tokens(SEQS, STARTS), grpc.StatusCode.UNIMPLEMENTED, "does not score")


@pytest.mark.vllm
def test_the_vllm_backend_scores_as_a_plain_forward_and_after_a_push(cfg, tiny_model_dir):
    """vLLM's prompt log-probs, on its engine thread: the tokens' log-probs of a plain forward of the
    same model (float32 on the CPU), and after a push, of the pushed version, named."""
    model = load_causal_lm(tiny_model_dir).eval()
    with serve(on_free_ports(backend_cfg(cfg, "vllm"), "generation")) as svc:
        client = GenerationClient(f"127.0.0.1:{svc.server.port}", cfg.rpc)
        got = client.score_tokens(SEQS, STARTS)
        assert got.policy_version == 0 and got.dtype == "float32"
        for ids, start, lp in zip(SEQS, STARTS, got.log_probs):
            assert torch.allclose(torch.tensor(lp), plain_log_probs(model, ids, start), atol=1e-3)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        client.update_weights(tied(model.state_dict()), 1)
        got = client.score_tokens(SEQS[:1], STARTS[:1])
        assert got.policy_version == 1
        assert torch.allclose(torch.tensor(got.log_probs[0]), plain_log_probs(model, SEQS[0], STARTS[0]), atol=1e-3)
        client.close()
