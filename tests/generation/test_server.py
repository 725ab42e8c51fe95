"""The generation server's contract, run against both backends (`hf` and `vllm`): a real server
on a loopback port, called through the generated client. The `vllm` cases carry the `vllm`
mark and run in the vLLM environment (`make test` runs them with .venv-vllm's Python)."""

import math
import resource
import threading

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.config import config_from_dict
from services.common.model_files import load_causal_lm
from services.common.modeling import response_log_probs
from services.common.rpc.errors import Reason, details_of, reason_of
from services.common.rpc.gen import generation_pb2 as gpb
from services.common.rpc.gen import generation_pb2_grpc
from services.common.token_batch import build_token_batch
from services.common.types import SamplingParams
from services.generation.backend import HFBackend
from services.generation.client import GenerationClient
from services.generation.server import serve
from services.weights.stream import StreamSpec, weight_chunks
from tests.grpc_helpers import TOKEN, expect_code, on_free_ports, restream
from tests.waits import wait_until

BACKENDS = ["hf", pytest.param("vllm", marks=pytest.mark.vllm)]
# vLLM's CPU build: float32 (the learner's dtype), no graph capture, a small KV cache
VLLM_CPU = {"enforce_eager": True, "cpu_kvcache_space_gb": 1}


def backend_cfg(cfg, backend: str, **generation):
    return config_from_dict(
        {
            **cfg.model_dump(),
            "generation": {
                **cfg.generation.model_dump(),
                "backend": backend,
                "dtype": "float32",
                "vllm": VLLM_CPU,
                **generation,
            },
        }
    )


class Served:
    """A running server, its servicer, and the weights it serves (tracked by the tests' pushes:
    the vLLM engine holds them in its own fused layout)."""

    def __init__(self, server, servicer, state):
        self.server, self.servicer, self.state = server, servicer, state

    def __iter__(self):  # server, servicer = served
        return iter((self.server, self.servicer))

    def __getitem__(self, i):
        return (self.server, self.servicer)[i]

    def assert_weights(self, state):
        """The backend holds exactly `state` (readable for hf; vLLM is checked by its outputs)."""
        backend = self.servicer.backend
        if hasattr(backend, "model"):
            for k, t in backend.model.state_dict().items():
                assert torch.equal(t, state[k]), k


@pytest.fixture(scope="module", params=BACKENDS)
def server(request, cfg, tiny_model_dir):
    state = {k: v.clone() for k, v in load_causal_lm(tiny_model_dir).state_dict().items()}
    with serve(on_free_ports(backend_cfg(cfg, request.param), "generation", metrics=True)) as svc:
        yield Served(svc.server, svc.servicer, state)


@pytest.fixture(scope="module")
def client(server, cfg):
    c = GenerationClient(f"127.0.0.1:{server[0].port}", cfg.rpc)
    yield c
    c.close()


def tied(state):
    """The tiny model ties its output layer to its embedding: a state dict as the learner sends it
    holds the same tensor under both names."""
    return {**state, "lm_head.weight": state["model.embed_tokens.weight"]}


def push(client, served, state, policy_version, **kw):
    resp = client.update_weights(state, policy_version, **kw)
    served.state = {k: v.clone() for k, v in state.items()}
    return resp


def test_generate_tokens_text_and_chat(client, server):
    stub, md = client.stub, client.metadata
    req = gpb.GenerateRequest(
        prompts=[
            gpb.Prompt(text="abc="),
            gpb.Prompt(tokens=gpb.TokenIds(ids=[1, 4, 5, 6, 30])),
            gpb.Prompt(chat=gpb.Chat(messages=[gpb.ChatMessage(role="user", content="ab")])),
        ],
        params=gpb.SamplingParams(n=2, max_new_tokens=5, seed=3),
    )
    resp = stub.Generate(req, metadata=md)
    assert len(resp.results) == 3 and all(len(r.completions) == 2 for r in resp.results)
    assert list(resp.results[0].prompt_token_ids) == client_tokens("abc=", server)
    for r in resp.results:
        for c in r.completions:
            assert len(c.token_ids) == len(c.log_probs) <= 5 and c.finish_reason in ("stop", "length")
    assert resp.policy_version == 0
    info = client.info()
    assert info.vocab_size > 0 and info.prompt_length == 32
    assert info.backend == server.servicer.backend.info()["backend"] == server.servicer.cfg.generation.backend
    assert info.engine_version.startswith({"hf": "transformers ", "vllm": "vllm "}[info.backend])
    assert info.dtype == "float32" and info.device == "cpu"
    assert info.partial_updates == server.servicer.backend.partial_updates == (info.backend == "hf")


def test_a_later_turn_may_be_longer_than_prompt_length(client):
    """A conversation's later turn: its first prompt within prompt_length (32), the turns after it
    within response_length (8), so the whole input may be longer than prompt_length."""
    ids = [1] + [4, 5, 6] * 12  # 37 tokens
    r = client.generate([ids], SamplingParams(max_new_tokens=1, temperature=0.0), first_prompt_tokens=[30])
    assert len(r.completions[0][0].token_ids) == 1
    with pytest.raises(grpc.RpcError) as e:  # the same tokens as one prompt are too long
        client.generate([ids], SamplingParams(max_new_tokens=1, temperature=0.0))
    assert "37 tokens, more than prompt_length=32" in e.value.details()


def client_tokens(text, server):
    return server[1].tok(text)["input_ids"]


def test_auth_refused_without_token(server, cfg):
    ch = grpc.insecure_channel(f"127.0.0.1:{server[0].port}")
    stub = generation_pb2_grpc.GenerationStub(ch)
    expect_code(lambda: stub.GetInfo(gpb.InfoRequest()), grpc.StatusCode.UNAUTHENTICATED, "bearer")
    expect_code(
        lambda: stub.GetInfo(gpb.InfoRequest(), metadata=(("authorization", "Bearer nope"),)),
        grpc.StatusCode.UNAUTHENTICATED,
    )
    # health stays open for probes
    h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="rlhf.v1.Generation"))
    assert h.status == health_pb2.HealthCheckResponse.SERVING


# (request, a fragment of the message, the field of a per-prompt error: Reason.PROMPT_INVALID)
@pytest.mark.parametrize(
    "req,fragment,field",
    [
        (gpb.GenerateRequest(), "prompts: empty batch", None),
        (
            gpb.GenerateRequest(prompts=[gpb.Prompt(tokens=gpb.TokenIds(ids=[1, 99999]))]),
            "prompts[0].tokens: token id 99999",
            "prompts[0].tokens",
        ),
        (
            gpb.GenerateRequest(prompts=[gpb.Prompt(text="ab="), gpb.Prompt(tokens=gpb.TokenIds(ids=[1, -3]))]),
            "token id -3",
            "prompts[1].tokens",
        ),
        (gpb.GenerateRequest(prompts=[gpb.Prompt(text="a" * 40)]), "more than prompt_length=32", "prompts[0]"),
        # a later turn of a conversation: its first prompt within prompt_length, the rest within response_length
        (
            gpb.GenerateRequest(prompts=[gpb.Prompt(tokens=gpb.TokenIds(ids=[1] * 38), first_prompt_tokens=33)]),
            "a conversation whose first prompt is 33 tokens, more than prompt_length=32",
            "prompts[0]",
        ),
        (
            gpb.GenerateRequest(prompts=[gpb.Prompt(tokens=gpb.TokenIds(ids=[1] * 38), first_prompt_tokens=30)]),
            "8 tokens of conversation after its first prompt leave no room for a reply in response_length=8",
            "prompts[0]",
        ),
        (
            gpb.GenerateRequest(prompts=[gpb.Prompt(tokens=gpb.TokenIds(ids=[1] * 5), first_prompt_tokens=6)]),
            "first_prompt_tokens: 6, more than the prompt's 5 tokens",
            "prompts[0].first_prompt_tokens",
        ),
        (
            gpb.GenerateRequest(prompts=[gpb.Prompt(text="ab=")], params=gpb.SamplingParams(n=9)),
            "params.n: 9 outside [1, 8]",
            None,
        ),
        (gpb.GenerateRequest(prompts=[gpb.Prompt(text="ab=")], params=gpb.SamplingParams(n=-1)), "params.n", None),
        (
            gpb.GenerateRequest(prompts=[gpb.Prompt(text="ab=")], params=gpb.SamplingParams(temperature=float("nan"))),
            "params.temperature: nan",
            None,
        ),
        (
            gpb.GenerateRequest(prompts=[gpb.Prompt(text="ab=")], params=gpb.SamplingParams(top_p=1.5)),
            "params.top_p",
            None,
        ),
        (
            gpb.GenerateRequest(prompts=[gpb.Prompt(text="ab=")], params=gpb.SamplingParams(max_new_tokens=100)),
            "response_length=8",
            None,
        ),
        (gpb.GenerateRequest(prompts=[gpb.Prompt()]), "prompts[0]: none of", "prompts[0]"),
        (gpb.GenerateRequest(prompts=[gpb.Prompt(tokens=gpb.TokenIds())]), "prompts[0]: empty prompt", "prompts[0]"),
    ],
)
def test_bad_generate_requests_are_invalid_argument_and_server_keeps_serving(client, req, fragment, field):
    """The reason a rollout worker acts on (isolate one prompt, or avoid the server) is in the
    status's error details, with the field; the message is for people."""
    with pytest.raises(grpc.RpcError) as e:
        client.stub.Generate(req, metadata=client.metadata)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and fragment in e.value.details()
    details = details_of(e.value)
    if field is None:
        assert details.reason is None and not details.violations
    else:
        assert details.reason is Reason.PROMPT_INVALID and details.metadata == {}
        assert [v.field for v in details.violations] == [field] and fragment in details.violations[0].description
    assert dict(e.value.trailing_metadata()).get("x-request-id")  # still there beside the details
    assert client.generate([[1, 4, 5, 30]], SamplingParams(max_new_tokens=2)).completions


def test_push_makes_server_generate_exactly_what_the_pushed_model_generates(client, server, tiny_model_dir):
    torch.manual_seed(0)
    reference = HFBackend(tiny_model_dir, "cpu")
    new_state = tied({k: v + 0.05 * torch.randn_like(v) if v.dim() == 2 else v for k, v in server.state.items()})
    reference.update_weights(new_state, 1)
    before = client.policy_version
    resp = push(client, server, new_state, before + 1, chunk_bytes=10_000)
    assert resp.policy_version == before + 1 and resp.bytes > 0
    prompts = [[1, 4, 5, 6, 30], [1, 11, 10, 9, 8, 30]]
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    served = client.generate(prompts, greedy)
    local = reference.generate(prompts, greedy)
    assert served.policy_version == before + 1
    assert [c[0].token_ids for c in served.completions] == [c[0].token_ids for c in local.completions]
    for a, b in zip(served.completions, local.completions):
        assert a[0].log_probs == pytest.approx(b[0].log_probs, abs=1e-5)


def _chunks_of(state, policy_version, mutate=None):
    chunks = list(weight_chunks(state, StreamSpec(policy_version, chunk_bytes=50_000)))
    if mutate:
        mutate(chunks)
    return iter(chunks)


def test_bad_pushes_are_refused_and_old_weights_keep_serving(client, server):
    good = server.state
    v = client.policy_version
    prompts = [[1, 4, 5, 6, 30]]
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    before = client.generate(prompts, greedy).completions[0][0].token_ids
    noisy = {k: t + 1.0 for k, t in good.items()}
    push = lambda chunks: client.stub.PushWeights(chunks, metadata=client.metadata)  # noqa: E731

    def corrupt(chunks):
        chunks[2].piece.data = bytes(len(chunks[2].piece.data))

    expect_code(lambda: push(_chunks_of(noisy, v + 1, corrupt)), grpc.StatusCode.INVALID_ARGUMENT, "xxh3 mismatch")

    def truncate(chunks):
        del chunks[3]

    expect_code(lambda: push(_chunks_of(noisy, v + 1, truncate)), grpc.StatusCode.INVALID_ARGUMENT, "missing")
    expect_code(
        lambda: push(_chunks_of({"lm_head.bias": torch.zeros(3)}, v + 1)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "unknown tensor 'lm_head.bias'",
    )
    name = "model.norm.weight"
    expect_code(
        lambda: push(_chunks_of({name: torch.zeros(7)}, v + 1)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "shape: [7], expected [128]",
    )
    expect_code(
        lambda: push(_chunks_of({name: torch.zeros(128, dtype=torch.float16)}, v + 1)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "dtype: float16, expected float32",
    )
    with pytest.raises(grpc.RpcError) as refused:
        push(_chunks_of(noisy, v))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason_of(refused.value) is Reason.VERSION_NOT_NEWER  # what a publisher counts as delivered
    expect_code(
        lambda: push(iter(list(weight_chunks(noisy, StreamSpec(v + 1)))[:-1])),
        grpc.StatusCode.INVALID_ARGUMENT,
        "without a footer",
    )
    assert client.policy_version == v
    assert client.generate(prompts, greedy).completions[0][0].token_ids == before
    server.assert_weights(good)


def _serves_unchanged(client, served, good, v, prompts, before):
    assert client.policy_version == v
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    assert client.generate(prompts, greedy).completions[0][0].token_ids == before
    served.assert_weights(good)


def test_every_byte_of_every_tensor_exactly_once_and_finite(client, server):
    good = server.state
    v = client.policy_version
    prompts = [[1, 4, 5, 6, 30]]
    before = client.generate(prompts, SamplingParams(temperature=0, max_new_tokens=8)).completions[0][0].token_ids
    noisy = {k: t + 1.0 for k, t in good.items()}
    push = lambda chunks: client.stub.PushWeights(chunks, metadata=client.metadata)  # noqa: E731
    name = "model.embed_tokens.weight"  # 66 x 128 float32: 33,792 bytes, 4 pieces of 8,448
    piece_bytes = good[name].numel() * 4 // 4

    def pieces_of(chunks):
        return [c for c in chunks if c.WhichOneof("payload") == "piece" and c.piece.name == name]

    # the piece at offset 0 twice and the one at 8,448 left out: the byte count is right, the ranges are not
    chunks = list(weight_chunks(noisy, StreamSpec(v + 1, chunk_bytes=piece_bytes)))
    first, second = pieces_of(chunks)[:2]
    second.CopyFrom(first)
    expect_code(
        lambda: push(iter(restream(chunks))),
        grpc.StatusCode.INVALID_ARGUMENT,
        f"weights.piece[{name}]: bytes [0, {piece_bytes}) were already received",
    )
    # only the hole
    chunks = list(weight_chunks(noisy, StreamSpec(v + 1, chunk_bytes=piece_bytes)))
    chunks.remove(pieces_of(chunks)[1])
    expect_code(
        lambda: push(iter(restream(chunks))),
        grpc.StatusCode.INVALID_ARGUMENT,
        f"bytes [{piece_bytes}, {2 * piece_bytes}) missing",
    )
    # a "full" push without a whole tensor
    without = {k: t for k, t in noisy.items() if k != "model.norm.weight"}
    expect_code(
        lambda: push(iter(weight_chunks(without, StreamSpec(v + 1)))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "a full push without 1 of the model's tensors: model.norm.weight",
    )
    # a format the server does not know
    expect_code(
        lambda: push(iter(weight_chunks(noisy, StreamSpec(v + 1, kind="sparse")))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "weights.header.format: 'sparse' is not one of full, partial, delta",
    )
    # NaN or infinity anywhere in a floating tensor
    for bad in (float("nan"), float("inf")):
        poisoned = dict(noisy)
        poisoned[name] = noisy[name].clone()
        poisoned[name][5, 7] = bad
        expect_code(
            lambda: push(iter(weight_chunks(poisoned, StreamSpec(v + 1)))),
            grpc.StatusCode.INVALID_ARGUMENT,
            f"weights.piece[{name}]: contains NaN or infinity",
        )
    _serves_unchanged(client, server, good, v, prompts, before)


def test_partial_push_replaces_only_its_tensors(client, server):
    good = server.state
    v = client.policy_version
    name = "model.norm.weight"
    new = good[name] * 1.5
    partial = lambda: client.stub.PushWeights(  # noqa: E731
        weight_chunks({name: new}, StreamSpec(v + 1, kind="partial")), metadata=client.metadata
    )
    if server.servicer.cfg.generation.backend == "vllm":
        # vLLM fuses q/k/v and gate/up projections: a layer loaded from part of its tensors would be
        # corrupt, so the vllm backend refuses partial pushes and keeps serving what it had
        prompts = [[1, 4, 5, 6, 30]]
        before = client.generate(prompts, SamplingParams(temperature=0, max_new_tokens=8)).completions[0][0].token_ids
        expect_code(partial, grpc.StatusCode.INVALID_ARGUMENT, "the vllm backend loads whole policies only")
        _serves_unchanged(client, server, good, v, prompts, before)
        return
    resp = partial()
    assert resp.policy_version == v + 1 and client.policy_version == v + 1
    server.state = {**good, name: new}
    server.assert_weights(server.state)
    # each tensor of a partial push is still complete
    chunks = list(weight_chunks({name: good[name]}, StreamSpec(v + 2, chunk_bytes=128, kind="partial")))
    del chunks[2]
    expect_code(
        lambda: client.stub.PushWeights(iter(restream(chunks)), metadata=client.metadata),
        grpc.StatusCode.INVALID_ARGUMENT,
        "bytes [128, 256) missing",
    )
    assert client.policy_version == v + 1


@pytest.mark.parametrize(
    "where,value,fragment",
    [
        ("piece.total_bytes", 1 << 32, ".total_bytes: 4294967296, but shape [66, 128] of float32 is 33792 bytes"),
        ("piece.total_bytes", 1 << 62, ".total_bytes: 4611686018427387904, but shape"),
        ("piece.total_bytes", -1, ".total_bytes: -1, but shape"),
        ("piece.total_bytes", 33792 + 4, ".total_bytes: 33796, but shape"),
        ("piece.offset", -8, "bytes [-8, "),
        ("header.total_bytes", -1, "weights.header.total_bytes: -1 is negative"),
        ("header.total_bytes", 1 << 62, "weights.header.total_bytes: 4611686018427387904, more than the model's"),
        ("header.total_bytes", "model+1", "more than the model's"),
        ("header.num_tensors", 0, "weights.header.num_tensors: 0 outside [1, 21]"),  # the tiny model has 21
        ("header.num_tensors", 22, "weights.header.num_tensors: 22 outside [1, 21]"),
    ],
)
def test_declared_sizes_are_checked_against_the_model_before_allocating(client, server, where, value, fragment):
    state = server.state
    v = client.policy_version
    if value == "model+1":
        value = sum(t.numel() * t.element_size() for t in state.values()) + 1
    chunks = list(weight_chunks(state, StreamSpec(v + 1, chunk_bytes=8448)))
    if where.startswith("header."):
        setattr(chunks[0].header, where.split(".")[1], value)
    else:
        for c in chunks:
            if c.WhichOneof("payload") == "piece" and c.piece.name == "model.embed_tokens.weight":
                setattr(c.piece, where.split(".")[1], value)
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    expect_code(
        lambda: client.stub.PushWeights(iter(restream(chunks)), metadata=client.metadata),
        grpc.StatusCode.INVALID_ARGUMENT,
        fragment,
    )
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_kb < 512 * 1024  # nothing of GiBs allocated
    assert client.policy_version == v


@pytest.mark.parametrize("temperature", [1e-39, 1e-30, 1e-6])
def test_tiny_temperatures_sample_greedily(client, temperature):
    prompts = [gpb.Prompt(tokens=gpb.TokenIds(ids=[1, 4, 5, 6, 30])), gpb.Prompt(text="abc=")]
    resp = client.stub.Generate(
        gpb.GenerateRequest(prompts=prompts, params=gpb.SamplingParams(n=2, temperature=temperature, max_new_tokens=6)),
        metadata=client.metadata,
    )
    # the greedy reference with the same n: the same batch (hf decodes prompts x n rows), so the same
    # float32 reductions; with n=1 the batch has other rows and log-probs move by ~1e-6 (float noise)
    greedy = client.stub.Generate(
        gpb.GenerateRequest(prompts=prompts, params=gpb.SamplingParams(n=2, temperature=0, max_new_tokens=6)),
        metadata=client.metadata,
    )
    for r, g in zip(resp.results, greedy.results):
        assert len(r.completions) == len(g.completions) == 2
        for c, ref in zip(r.completions, g.completions):
            assert c.log_probs and all(math.isfinite(lp) and lp <= 0 for lp in c.log_probs)
            assert list(c.token_ids) == list(ref.token_ids)
            assert list(c.log_probs) == pytest.approx(list(ref.log_probs), abs=1e-6)


def test_prompt_errors_start_with_the_prompt_and_request_errors_do_not(client):
    """Rollout workers dead-letter one prompt when the error starts with "prompts[", and treat any
    other INVALID_ARGUMENT as the whole request's."""
    ok = gpb.Prompt(tokens=gpb.TokenIds(ids=[1, 4, 5, 30]))
    bad = gpb.Prompt(tokens=gpb.TokenIds(ids=[1, 99999]))
    generate = lambda req: lambda: client.stub.Generate(req, metadata=client.metadata)  # noqa: E731
    # a request-level error is reported as such even when a prompt is bad too
    for params, fragment in [
        (gpb.SamplingParams(max_new_tokens=100), "params.max_new_tokens"),
        (gpb.SamplingParams(n=9), "params.n"),
        (gpb.SamplingParams(top_p=2), "params.top_p"),
    ]:
        details = expect_code(
            generate(gpb.GenerateRequest(prompts=[ok, bad], params=params)), grpc.StatusCode.INVALID_ARGUMENT, fragment
        )
        assert not details.startswith("prompts["), details
    details = expect_code(generate(gpb.GenerateRequest()), grpc.StatusCode.INVALID_ARGUMENT, "prompts: empty")
    assert not details.startswith("prompts[")
    for i, prompt in [
        (1, bad),
        (0, gpb.Prompt()),
        (2, gpb.Prompt(text="a" * 40)),
        (1, gpb.Prompt(chat=gpb.Chat())),
        (0, gpb.Prompt(tokens=gpb.TokenIds())),
    ]:
        prompts = [ok] * 3
        prompts[i] = prompt
        req = gpb.GenerateRequest(prompts=prompts, params=gpb.SamplingParams(max_new_tokens=2))
        details = expect_code(generate(req), grpc.StatusCode.INVALID_ARGUMENT)
        assert details.startswith(f"prompts[{i}]"), details


def _reference(served, tiny_model_dir):
    """The transformers model with the weights the server serves."""
    model = load_causal_lm(tiny_model_dir).eval()
    model.load_state_dict(served.state)
    return model


def test_greedy_and_stop_tokens_equal_the_transformers_reference(client, server, tiny_model_dir):
    ref = HFBackend(tiny_model_dir, "cpu")
    ref.model.load_state_dict(server.state)
    prompts = [[1, 4, 5, 6, 30], [1, 11, 10, 9, 8, 30], [1, 7, 30], [1, 20, 21, 22, 23, 24, 25, 30]]
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    served, local = client.generate(prompts, greedy), ref.generate(prompts, greedy)
    assert [c[0].token_ids for c in served.completions] == [c[0].token_ids for c in local.completions]
    assert [c[0].finish_reason for c in served.completions] == [c[0].finish_reason for c in local.completions]
    for a, b in zip(served.completions, local.completions):
        assert a[0].log_probs == pytest.approx(b[0].log_probs, abs=1e-4)
    # a stop token ends the completion, which holds it, with finish_reason "stop"
    first = local.completions[0][0].token_ids[1]
    stopped = client.generate(prompts[:1], SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=[first]))
    c = stopped.completions[0][0]
    assert c.token_ids == local.completions[0][0].token_ids[:2] and c.finish_reason == "stop"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_log_probs_equal_the_learners_recomputation(client, server, tiny_model_dir, temperature):
    """The sampler's log-probs are those of the distribution it drew from (temperature applied),
    what the learner's `response_log_probs` computes for the same tokens."""
    prompts = [[1, 4, 5, 6, 30], [1, 11, 10, 9, 8, 30], [1, 7, 30]]
    res = client.generate(prompts, SamplingParams(n=4, temperature=temperature, max_new_tokens=8, seed=5))
    rows = [(p, c) for p, cs in zip(prompts, res.completions) for c in cs]
    batch = build_token_batch([p for p, _ in rows], [c.token_ids for _, c in rows], 0)
    with torch.no_grad():
        learner = response_log_probs(_reference(server, tiny_model_dir), batch, temperature)["log_probs"]
    worst = max(abs(learner[i, j].item() - lp) for i, (_, c) in enumerate(rows) for j, lp in enumerate(c.log_probs))
    assert worst < 1e-4, worst
    assert sum(len(c.token_ids) for _, c in rows) > 3 * len(rows)  # something was really sampled


def test_a_seed_repeats_its_samples_and_n_samples_differ(client):
    prompts = [[1, 4, 5, 6, 30], [1, 11, 10, 9, 8, 30]]
    params = SamplingParams(n=4, temperature=1.5, max_new_tokens=8, seed=123)
    a, b = client.generate(prompts, params), client.generate(prompts, params)
    assert [[c.token_ids for c in cs] for cs in a.completions] == [[c.token_ids for c in cs] for cs in b.completions]
    assert all(len({tuple(c.token_ids) for c in cs}) > 1 for cs in a.completions)
    for cs in a.completions:
        for c in cs:
            assert len(c.token_ids) == len(c.log_probs) and c.finish_reason in ("stop", "length")
            assert (c.finish_reason == "length") == (len(c.token_ids) == 8 and c.token_ids[-1] != 2)


@pytest.mark.parametrize("seed", [-(2**63), -1, 0, 2**63 - 1])
def test_every_int64_seed_the_wire_carries_samples_and_repeats(client, seed):
    """The proto's seed is an int64: both ends of its range (and -1) are seeds like any other."""
    params = SamplingParams(n=2, temperature=1.5, max_new_tokens=6, seed=seed)
    a, b = (client.generate([[1, 4, 5, 6, 30]], params) for _ in range(2))
    assert [c.token_ids for c in a.completions[0]] == [c.token_ids for c in b.completions[0]]
    assert all(c.token_ids for c in a.completions[0])


@pytest.fixture(scope="module")
def small_server(cfg):
    """A server that allows 200 token positions per request."""
    with serve(
        on_free_ports(
            config_from_dict({**cfg.model_dump(), "rpc": {**cfg.rpc.model_dump(), "max_request_tokens": 200}}),
            "generation",
        )
    ) as svc:
        c = GenerationClient(f"127.0.0.1:{svc.server.port}", cfg.rpc)
        yield svc.servicer, c
        c.close()


def test_one_request_may_not_cost_more_than_max_request_tokens(small_server, monkeypatch):
    servicer, client = small_server
    generate = lambda req: lambda: client.stub.Generate(req, metadata=client.metadata)  # noqa: E731
    tokens = gpb.Prompt(tokens=gpb.TokenIds(ids=[1, 4, 5, 6, 30]))
    # 4 prompts x n=4 x (5 + 8) = 208
    expect_code(
        generate(gpb.GenerateRequest(prompts=[tokens] * 4, params=gpb.SamplingParams(n=4))),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "request: 4 prompts x n=4 x (5 prompt tokens + max_new_tokens=8) = 208 token positions, more than "
        "rpc.max_request_tokens=200",
    )
    # text prompts: refused from the prompt count alone, before anything is tokenized
    calls = []
    real = servicer.tok

    class Spy:
        def __call__(self, *a, **kw):
            calls.append(a)
            return real(*a, **kw)

        def __getattr__(self, name):
            return getattr(real, name)

    monkeypatch.setattr(servicer, "tok", Spy())
    expect_code(
        generate(gpb.GenerateRequest(prompts=[gpb.Prompt(text="abc=")] * 30)),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "30 prompts x n=1 x (at least 1 prompt tokens",
    )
    assert calls == []
    # ... and by their exact length once tokenized
    long_text = "abcdefghijklmnopqrst="
    width = len(real(long_text)["input_ids"])
    assert 10 * (1 + 8) <= 200 < 10 * (width + 8)
    expect_code(
        generate(gpb.GenerateRequest(prompts=[gpb.Prompt(text=long_text)] * 10)),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"10 prompts x n=1 x ({width} prompt tokens",
    )
    # within the limit: served
    resp = client.stub.Generate(
        gpb.GenerateRequest(prompts=[tokens] * 2, params=gpb.SamplingParams(n=2)), metadata=client.metadata
    )
    assert len(resp.results) == 2 and all(len(r.completions) == 2 for r in resp.results)


def test_no_sample_mixes_versions_during_a_push(client, server, tiny_model_dir):
    """Hammer Generate while pushing: each response's tokens must be what its reported version
    produces greedily."""
    ref = HFBackend(tiny_model_dir, "cpu")
    states = {}
    v0 = client.policy_version
    base = server.state
    for i in range(1, 4):
        torch.manual_seed(i)
        states[v0 + i] = tied({k: t + 0.1 * torch.randn_like(t) if t.dim() == 2 else t for k, t in base.items()})
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
        push(client, server, states[v], v, chunk_bytes=20_000)
    try:
        wait_until(lambda: any(v == v0 + 3 for v, _ in list(seen)), "a call answered by the last version")
    finally:
        stop.set()
    for t in threads:
        t.join()
    # the server merges concurrent calls into batches of 1 to 3 rows: a version's greedy answer is
    # that of one of those shapes (float32 rounding differs with the batch shape)
    expected = {}
    for v, st in states.items():
        ref.model.load_state_dict(st)
        expected[v] = {tuple(ref.generate(prompts * rows, greedy).completions[0][0].token_ids) for rows in (1, 2, 3)}
    assert all(not (expected[a] & expected[b]) for a in states for b in states if a < b)  # versions tell apart
    assert {v for v, _ in seen} >= {v0 + 3}
    for v, toks in seen:
        assert tuple(toks) in expected[v], f"version {v}"


def test_concurrent_calls_are_batched(cfg, tiny_model_dir):
    """The hf backend's window: calls that arrive together share a backend batch."""
    with serve(
        on_free_ports(
            config_from_dict({**cfg.model_dump(), "generation": {"batch_window_ms": 200, "max_batch_size": 64}}),
            "generation",
        )
    ) as svc:
        srv, servicer = svc.server, svc.servicer
        c = GenerationClient(f"127.0.0.1:{srv.port}", cfg.rpc)
        before = servicer.batcher.batches
        results = []
        threads = [
            threading.Thread(
                target=lambda: results.append(c.generate([[1, 4, 5, 30]], SamplingParams(max_new_tokens=4)))
            )
            for _ in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(results) == 8 and all(len(r.completions) == 1 for r in results)
        assert servicer.batcher.batches - before < 8  # fewer backend batches than calls


def test_metrics_endpoint(server, client):
    import httpx

    client.generate([[1, 4, 5, 30]], SamplingParams(max_new_tokens=2))
    text = httpx.get(
        f"http://127.0.0.1:{server[0].metrics_port}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}
    ).text
    assert 'rlhf_rpc_requests_total{code="OK",method="Generate",service="generation"}' in text
    assert 'code="INVALID_ARGUMENT"' in text and 'code="UNAUTHENTICATED"' in text
    assert "rlhf_rpc_latency_seconds_bucket" in text and "rlhf_generated_tokens_total" in text
