"""A real generation server on a loopback port, called through the generated client."""
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.config import config_from_dict
from services.common.rpc.codec import weight_chunks
from services.common.rpc.gen import generation_pb2 as gpb, generation_pb2_grpc
from services.common.types import SamplingParams
from services.generation.backend import HFBackend
from services.generation.client import GenerationClient
from services.generation.server import serve

from tests.grpc_helpers import TOKEN, expect_code


@pytest.fixture(scope="module")
def server(cfg):
    with serve(cfg, port=0, metrics_port=0) as svc:
        yield svc.server, svc.servicer


@pytest.fixture(scope="module")
def client(server, cfg):
    c = GenerationClient(f"127.0.0.1:{server[0].port}", cfg.rpc)
    yield c
    c.close()


def test_generate_tokens_text_and_chat(client, server):
    stub, md = client.stub, client.metadata
    req = gpb.GenerateRequest(prompts=[gpb.Prompt(text="abc="), gpb.Prompt(tokens=gpb.TokenIds(ids=[1, 4, 5, 6, 30])),
                                       gpb.Prompt(chat=gpb.Chat(messages=[gpb.ChatMessage(role="user", content="ab")]))],
                              params=gpb.SamplingParams(n=2, max_new_tokens=5, seed=3))
    resp = stub.Generate(req, metadata=md)
    assert len(resp.results) == 3 and all(len(r.completions) == 2 for r in resp.results)
    assert list(resp.results[0].prompt_token_ids) == client_tokens("abc=", server)
    for r in resp.results:
        for c in r.completions:
            assert len(c.token_ids) == len(c.log_probs) <= 5 and c.finish_reason in ("stop", "length")
    assert resp.policy_version == 0
    info = client.info()
    assert info.vocab_size > 0 and info.prompt_length == 32 and info.backend == "hf"


def client_tokens(text, server):
    return server[1].tok(text)["input_ids"]


def test_auth_refused_without_token(server, cfg):
    ch = grpc.insecure_channel(f"127.0.0.1:{server[0].port}")
    stub = generation_pb2_grpc.GenerationStub(ch)
    expect_code(lambda: stub.GetInfo(gpb.InfoRequest()), grpc.StatusCode.UNAUTHENTICATED, "bearer")
    expect_code(lambda: stub.GetInfo(gpb.InfoRequest(), metadata=(("authorization", "Bearer nope"),)),
                grpc.StatusCode.UNAUTHENTICATED)
    # health stays open for probes
    h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="rlhf.v1.Generation"))
    assert h.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("req,fragment", [
    (gpb.GenerateRequest(), "prompts: empty batch"),
    (gpb.GenerateRequest(prompts=[gpb.Prompt(tokens=gpb.TokenIds(ids=[1, 99999]))]), "prompts[0].tokens: token id 99999"),
    (gpb.GenerateRequest(prompts=[gpb.Prompt(tokens=gpb.TokenIds(ids=[1, -3]))]), "token id -3"),
    (gpb.GenerateRequest(prompts=[gpb.Prompt(text="a" * 40)]), "more than prompt_length=32"),
    (gpb.GenerateRequest(prompts=[gpb.Prompt(text="ab=")], params=gpb.SamplingParams(n=9)), "params.n: 9 outside [1, 8]"),
    (gpb.GenerateRequest(prompts=[gpb.Prompt(text="ab=")], params=gpb.SamplingParams(n=-1)), "params.n"),
    (gpb.GenerateRequest(prompts=[gpb.Prompt(text="ab=")], params=gpb.SamplingParams(temperature=float("nan"))),
     "params.temperature: nan"),
    (gpb.GenerateRequest(prompts=[gpb.Prompt(text="ab=")], params=gpb.SamplingParams(top_p=1.5)), "params.top_p"),
    (gpb.GenerateRequest(prompts=[gpb.Prompt(text="ab=")], params=gpb.SamplingParams(max_new_tokens=100)),
     "response_length=8"),
    (gpb.GenerateRequest(prompts=[gpb.Prompt()]), "prompts[0]: none of"),
    (gpb.GenerateRequest(prompts=[gpb.Prompt(tokens=gpb.TokenIds())]), "prompts[0]: empty prompt"),
])
def test_bad_generate_requests_are_invalid_argument_and_server_keeps_serving(client, req, fragment):
    expect_code(lambda: client.stub.Generate(req, metadata=client.metadata), grpc.StatusCode.INVALID_ARGUMENT, fragment)
    assert client.generate([[1, 4, 5, 30]], SamplingParams(max_new_tokens=2)).completions


def test_push_makes_server_generate_exactly_what_the_pushed_model_generates(client, cfg, tiny_model_dir):
    torch.manual_seed(0)
    reference = HFBackend(tiny_model_dir, "cpu")
    new_state = {k: v + 0.05 * torch.randn_like(v) if v.dim() == 2 else v
                 for k, v in reference.model.state_dict().items()}
    reference.update_weights(new_state, 1)
    before = client.version
    resp = client.update_weights(new_state, before + 1, chunk_bytes=10_000)
    assert resp.version == before + 1 and resp.bytes > 0
    prompts = [[1, 4, 5, 6, 30], [1, 11, 10, 9, 8, 30]]
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    served = client.generate(prompts, greedy)
    local = reference.generate(prompts, greedy)
    assert served.policy_version == before + 1
    assert [c[0].token_ids for c in served.completions] == [c[0].token_ids for c in local.completions]
    for a, b in zip(served.completions, local.completions):
        assert a[0].log_probs == pytest.approx(b[0].log_probs, abs=1e-5)


def _chunks_of(state, version, mutate=None):
    chunks = list(weight_chunks(state, version, chunk_bytes=50_000))
    if mutate:
        mutate(chunks)
    return iter(chunks)


def test_bad_pushes_are_refused_and_old_weights_keep_serving(client, server):
    backend = server[1].backend
    good = {k: v.clone() for k, v in backend.model.state_dict().items()}
    v = client.version
    prompts = [[1, 4, 5, 6, 30]]
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    before = client.generate(prompts, greedy).completions[0][0].token_ids
    noisy = {k: t + 1.0 for k, t in good.items()}
    push = lambda chunks: client.stub.PushWeights(chunks, metadata=client.metadata)  # noqa: E731

    def corrupt(chunks):
        chunks[2].piece.data = bytes(len(chunks[2].piece.data))
    expect_code(lambda: push(_chunks_of(noisy, v + 1, corrupt)), grpc.StatusCode.INVALID_ARGUMENT, "crc32")

    def truncate(chunks):
        del chunks[3]
    expect_code(lambda: push(_chunks_of(noisy, v + 1, truncate)), grpc.StatusCode.INVALID_ARGUMENT, "checksum")
    expect_code(lambda: push(_chunks_of({"lm_head.bias": torch.zeros(3)}, v + 1)), grpc.StatusCode.INVALID_ARGUMENT,
                "unknown tensor 'lm_head.bias'")
    name = "model.norm.weight"
    expect_code(lambda: push(_chunks_of({name: torch.zeros(7)}, v + 1)), grpc.StatusCode.INVALID_ARGUMENT,
                "shape: [7], expected [128]")
    expect_code(lambda: push(_chunks_of({name: torch.zeros(128, dtype=torch.float16)}, v + 1)),
                grpc.StatusCode.INVALID_ARGUMENT, "dtype: float16, expected float32")
    expect_code(lambda: push(_chunks_of(noisy, v)), grpc.StatusCode.INVALID_ARGUMENT, "not newer")
    expect_code(lambda: push(iter(list(weight_chunks(noisy, v + 1))[:-1])), grpc.StatusCode.INVALID_ARGUMENT,
                "without a footer")
    assert client.version == v
    assert client.generate(prompts, greedy).completions[0][0].token_ids == before
    for k, t in backend.model.state_dict().items():
        assert torch.equal(t, good[k])


def test_no_sample_mixes_versions_during_a_push(client, server, tiny_model_dir):
    """Hammer Generate while pushing: each response's tokens must be what its reported version
    produces greedily."""
    ref = HFBackend(tiny_model_dir, "cpu")
    states = {}
    v0 = client.version
    base = {k: t.clone() for k, t in server[1].backend.model.state_dict().items()}
    for i in range(1, 4):
        torch.manual_seed(i)
        states[v0 + i] = {k: t + 0.1 * torch.randn_like(t) if t.dim() == 2 else t for k, t in base.items()}
    states[v0] = base
    prompts = [[1, 4, 5, 6, 30]]
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    seen = []
    stop = threading.Event()

    def hammer():
        while not stop.is_set():
            r = client.generate(prompts, greedy)
            seen.append((r.policy_version, r.completions[0][0].token_ids))

    threads = [threading.Thread(target=hammer) for _ in range(3)]
    for t in threads:
        t.start()
    for v in range(v0 + 1, v0 + 4):
        client.update_weights(states[v], v, chunk_bytes=20_000)
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join()
    expected = {}
    for v, st in states.items():
        ref.model.load_state_dict(st)
        expected[v] = ref.generate(prompts, greedy).completions[0][0].token_ids
    assert {v for v, _ in seen} >= {v0 + 3}
    for v, toks in seen:
        assert toks == expected[v], f"version {v}"


def test_concurrent_calls_are_batched(cfg, tiny_model_dir):
    with serve(config_from_dict({**cfg.model_dump(), "generation": {
            "batch_window_ms": 200, "max_batch_size": 64}}), port=0, metrics_port=None) as svc:
        srv, servicer = svc.server, svc.servicer
        c = GenerationClient(f"127.0.0.1:{srv.port}", cfg.rpc)
        before = servicer.batcher.batches
        results = []
        threads = [threading.Thread(target=lambda: results.append(
            c.generate([[1, 4, 5, 30]], SamplingParams(max_new_tokens=4)))) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(results) == 8 and all(len(r.completions) == 1 for r in results)
        assert servicer.batcher.batches - before < 8  # fewer backend batches than calls


def test_metrics_endpoint(server, client):
    import httpx
    client.generate([[1, 4, 5, 30]], SamplingParams(max_new_tokens=2))
    text = httpx.get(f"http://127.0.0.1:{server[0].metrics_port}/metrics").text
    assert 'rlhf_rpc_requests_total{code="OK",method="Generate",service="generation"}' in text
    assert 'code="INVALID_ARGUMENT"' in text and 'code="UNAUTHENTICATED"' in text
    assert "rlhf_rpc_latency_seconds_bucket" in text and "rlhf_generated_tokens_total" in text
