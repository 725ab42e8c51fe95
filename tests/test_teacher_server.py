"""The teacher server of on-policy distillation (real gRPC over loopback, the tiny model): its
log-probs and top-k equal a plain forward of the teacher's model on the same tokens, whatever the
padding and micro-batching; a teacher whose tokenizer differs from the policy's is refused at
start with one sentence; every malformed request is INVALID_ARGUMENT naming its field, never an
internal error; the bearer token is required; a worker's client rides through a restart."""

import shutil
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
import torch

from services.common.config import config_from_dict
from services.common.model_files import load_causal_lm, load_tokenizer
from services.common.replay.embedded import free_port
from services.common.rpc.errors import details_of
from services.common.rpc.gen import teacher_pb2 as tpb
from services.common.rpc.gen import teacher_pb2_grpc
from services.common.types import Teacher as TeacherProtocol
from services.teacher.client import TeacherClient, teacher_client
from services.teacher.server import serve
from services.teacher.teacher import Teacher, check_tokenizers, tokenizer_fingerprint
from tests.grpc_helpers import TOKEN, expect_code, on_free_ports
from tests.waits import wait_until

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[1, 4, 5, 6, 30], [1, 12], [1, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 31], [1, 7, 8]]
RESPONSES = [[7, 8, 9], [13, 14, 15, 16, 17, 18, 19, 20], [5], []]


def _cfg(policy_dir, teacher_dir, **rpc):
    """The policy at `policy_dir`, the teacher at `teacher_dir` (the same tokenizer), auth on."""
    return config_from_dict(
        {
            "model": {"path": policy_dir, "device": "cpu"},
            "prompt_length": 16,
            "response_length": 8,
            "distill": {"enabled": True, "teacher_path": teacher_dir, "micro_batch_size": 3},
            "rpc": {"auth_token": TOKEN, **rpc},
        }
    )


@pytest.fixture(scope="module")
def cfg(untrained_model_dir, tiny_model_dir):
    return _cfg(untrained_model_dir, tiny_model_dir)


@pytest.fixture(scope="module")
def teacher(cfg):
    """The teacher the config describes, loaded once for the module's servers."""
    return Teacher.from_config(cfg)


@pytest.fixture(scope="module")
def served(cfg, teacher):
    with serve(on_free_ports(cfg, "teacher"), teacher=teacher) as svc:
        client = TeacherClient(f"127.0.0.1:{svc.server.port}", cfg.rpc)
        yield svc, client
        client.close()


def plain_log_probs(model, prompt, response) -> torch.Tensor:
    """log p(. | prompt + response[:t]) over the whole vocabulary (T, V): one unpadded forward."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]


def test_log_probs_and_top_k_equal_a_plain_forward_of_the_teacher(served, tiny_model_dir):
    _, client = served
    model = load_causal_lm(tiny_model_dir).eval()
    got = client.score(PROMPTS, RESPONSES, top_k=5)
    assert got.top_ids is not None and got.top_log_probs is not None
    assert [len(lp) for lp in got.log_probs] == [len(r) for r in RESPONSES]
    for prompt, response, lp, ids, tops in zip(PROMPTS, RESPONSES, got.log_probs, got.top_ids, got.top_log_probs):
        if not response:
            assert lp == ids == tops == []
            continue
        full = plain_log_probs(model, prompt, response)
        want = full.gather(-1, torch.tensor(response)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(lp), want, atol=1e-5)
        top = full.topk(5, dim=-1)
        assert torch.equal(torch.tensor(ids), top.indices)
        assert torch.allclose(torch.tensor(tops), top.values, atol=1e-5)


def test_top_k_is_the_same_through_the_chunked_output_layer_and_the_full_logits(tiny_model_dir):
    """`response_log_probs(top_k=...)`: the chunked output layer (the teacher's path) and the full
    logits (kl_penalty 'full', a scaled head) give the same top-k, beside the entropy too."""
    from services.common.modeling import response_log_probs
    from services.common.token_batch import build_token_batch

    model = load_causal_lm(tiny_model_dir).eval()
    batch = build_token_batch(PROMPTS[:3], RESPONSES[:3], 0)
    with torch.no_grad():
        chunked = response_log_probs(model, batch, with_entropy=True, top_k=4)
        full = response_log_probs(model, batch, with_entropy=True, full=True, top_k=4)
    assert chunked["top_ids"].dtype == torch.long and chunked["top_ids"].shape == (3, 8, 4)
    assert torch.equal(chunked["top_ids"], full["top_ids"])
    for key in ("log_probs", "entropy", "top_log_probs"):
        assert torch.allclose(chunked[key], full[key], atol=1e-5), key


def test_gathered_log_probs_are_the_full_log_softmax_at_those_tokens_gradients_too(tiny_model_dir):
    """`response_log_probs(gather_ids=...)` (the top-k forward KL's read of the teacher's tokens
    under the policy): through the chunked output layer, with gradients (its chunks recomputed in
    the backward), the same values and the same gradient as gathering from the full logits."""
    from services.common.modeling import response_log_probs
    from services.common.token_batch import build_token_batch

    model = load_causal_lm(tiny_model_dir)
    model.eval()  # no dropout: both passes see the same function
    batch = build_token_batch(PROMPTS[:3], RESPONSES[:3], 0)
    ids = torch.randint(model.config.vocab_size, (3, 8, 5), generator=torch.Generator().manual_seed(0))

    def read(full: bool):
        model.zero_grad(set_to_none=True)
        out = response_log_probs(model, batch, full=full, gather_ids=ids)["gathered_log_probs"]
        (out * torch.linspace(-1, 1, 5)).sum().backward()
        return out.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    (chunked, g_chunked), (full, g_full) = read(False), read(True)
    assert chunked.shape == (3, 8, 5)
    torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_chunked, g_full, rtol=1e-4, atol=1e-6)


def test_without_top_k_only_log_probs_come_back(served):
    _, client = served
    got = client.score(PROMPTS[:2], RESPONSES[:2])
    assert got.top_ids is None and got.top_log_probs is None and len(got.log_probs[1]) == 8


def test_padding_and_micro_batching_do_not_change_the_scores(served, tiny_model_dir):
    """Each sequence alone, unpadded, in micro-batches of one, against the server's batch (micro-
    batches of 3, each padded to its longest): the same numbers, up to float noise."""
    _, client = served
    batched = client.score(PROMPTS, RESPONSES, top_k=3)
    alone = Teacher(tiny_model_dir, "cpu", micro_batch_size=1)
    for i in range(len(PROMPTS)):
        one = alone.score([PROMPTS[i]], [RESPONSES[i]], top_k=3)
        assert torch.allclose(torch.tensor(one.log_probs[0]), torch.tensor(batched.log_probs[i]), atol=1e-5)
        assert one.top_ids[0] == batched.top_ids[i]
    # one short sequence beside a long one: padding it to the long one changes nothing
    pair = client.score([PROMPTS[1], PROMPTS[2]], [RESPONSES[0], RESPONSES[1]])
    assert torch.allclose(
        torch.tensor(pair.log_probs[0]), torch.tensor(alone.score([PROMPTS[1]], [RESPONSES[0]]).log_probs[0]), atol=1e-5
    )


@pytest.mark.parametrize("head", ["plain", "full logits"])
def test_samples_of_one_prompt_share_its_forward_and_score_as_if_read_whole(tiny_model_dir, monkeypatch, head):
    """A group's samples (4 responses to each of 3 prompts, of other lengths, one empty, beside a
    prompt of one token and one asked once) scored with the prompts' keys and values reused equal
    each sequence read whole, in log-probs and top-k; the shared path really ran (one prefix
    forward per piece), in pieces of at most micro_batch_size responses. Also through the full
    logits (a head that is not a plain Linear: soft-capped, scaled)."""
    if head == "full logits":
        monkeypatch.setattr("services.common.modeling._head_is_plain", lambda model: False)
    prompts = [PROMPTS[0]] * 4 + [PROMPTS[2]] * 4 + [PROMPTS[3]] * 4 + [[1], [1], PROMPTS[1]]
    responses = [
        [7, 8, 9], [10], [11, 12, 13, 14, 15], [],
        [5], [5, 6], [40, 41, 42, 43, 44, 45, 46, 47], [9, 9, 9],
        [2, 3], [4, 5, 6, 7], [8], [30, 31],
        [5, 6], [7], [13, 14, 15],
    ]  # fmt: skip
    shared = Teacher(tiny_model_dir, "cpu", micro_batch_size=5)
    whole = Teacher(tiny_model_dir, "cpu", micro_batch_size=1, share_prompts=False)
    calls = []
    real = shared._shared
    monkeypatch.setattr(
        shared, "_shared", lambda piece, *a: calls.append(sum(len(r) for _, r in piece)) or real(piece, *a)
    )
    got = shared.score(prompts, responses, top_k=3)
    want = whole.score(prompts, responses, top_k=3)
    assert calls == [3, 4, 4]  # 11 shared responses (the empty one is not read), at most 5 a piece
    for i, response in enumerate(responses):
        assert len(got.log_probs[i]) == len(response)
        assert torch.allclose(torch.tensor(got.log_probs[i]), torch.tensor(want.log_probs[i]), atol=1e-4), i
        assert got.top_ids[i] == want.top_ids[i], i
        assert torch.allclose(torch.tensor(got.top_log_probs[i]), torch.tensor(want.top_log_probs[i]), atol=1e-4)


def test_info_names_the_model_dtype_and_tokenizer(served, cfg, tiny_model_dir):
    svc, client = served
    info = client.info()
    assert info.model_path == tiny_model_dir and info.dtype == "float32"
    assert info.vocab_size == len(load_tokenizer(tiny_model_dir))
    assert info.tokenizer_fingerprint == tokenizer_fingerprint(load_tokenizer(cfg.model.path))
    assert info.incarnation == svc.servicer.incarnation and info.started_at > 0
    as_protocol: TeacherProtocol = client  # what the trainer holds: the client is a `Teacher`
    assert as_protocol.score(PROMPTS[:1], RESPONSES[:1]).log_probs[0]


def test_a_bfloat16_teacher_stays_close_and_says_so(cfg, tiny_model_dir):
    half = cfg.model_copy(update={"distill": cfg.distill.model_copy(update={"dtype": "bfloat16"})})
    model = load_causal_lm(tiny_model_dir).eval()
    with serve(on_free_ports(half, "teacher")) as svc:
        client = TeacherClient(f"127.0.0.1:{svc.server.port}", cfg.rpc)
        got = client.score(PROMPTS[:3], RESPONSES[:3], top_k=4)
        assert client.info().dtype == "bfloat16"
        client.close()
    for prompt, response, lp, ids, tops in zip(PROMPTS, RESPONSES, got.log_probs, got.top_ids, got.top_log_probs):
        full = plain_log_probs(model, prompt, response)
        want = full.gather(-1, torch.tensor(response)[:, None])[:, 0]
        assert (torch.tensor(lp) - want).abs().mean() < 0.1  # bfloat16's rounding, not another model
        # whole token ids, each one's own log-prob beside it
        assert all(0 <= t < full.shape[-1] for row in ids for t in row)
        near = full.gather(-1, torch.tensor(ids))
        assert (near - torch.tensor(tops)).abs().max() < 0.2


def _other_tokenizer_model(src: str, dest: Path) -> Path:
    """A copy of the model at `src` whose tokenizer has one more token."""
    shutil.copytree(src, dest)
    tok = load_tokenizer(dest)
    tok.add_tokens(["<another>"])
    tok.save_pretrained(dest)
    return dest


def test_a_teacher_of_another_tokenizer_is_refused_at_start(untrained_model_dir, tmp_path):
    other = _other_tokenizer_model(untrained_model_dir, tmp_path / "other")
    bad = on_free_ports(_cfg(untrained_model_dir, str(other)), "teacher")
    svc = serve(bad)
    with pytest.raises(ValueError) as e:
        with svc:
            pass
    n = len(load_tokenizer(untrained_model_dir))
    assert str(e.value) == (
        f"the teacher's tokenizer ({other}, {n + 1:,} tokens) differs from the policy's ({untrained_model_dir}, "
        f"{n:,} tokens), first at token id {n} ('<another>' in the teacher's, no token in the policy's): the "
        "teacher scores the policy's token ids, so distill.teacher_path must share model.path's tokenizer"
    )
    assert svc.server is None  # nothing bound


def test_rlhf_serve_teacher_says_the_sentence_and_exits(untrained_model_dir, tmp_path):
    other = _other_tokenizer_model(untrained_model_dir, tmp_path / "other")
    args = ["-c", "configs/tiny-cpu.yaml", "--set", f"model.path={untrained_model_dir}"]
    args += ["--set", "distill.enabled=true", "--set", f"distill.teacher_path={other}", "--port", "0"]
    p = subprocess.run(
        [sys.executable, "-m", "services.cli", "serve", "teacher", *args, "--metrics-port", "-1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode != 0 and "LISTENING" not in p.stdout
    assert "error: the teacher's tokenizer" in p.stderr and "first at token id" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


class _Vocab:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return dict(self.vocab)


def test_tokenizers_of_the_same_size_with_other_ids_are_told_apart():
    same = {"a": 0, "b": 1, "c": 2}
    check_tokenizers(_Vocab(same), _Vocab(same), "t", "s")
    with pytest.raises(ValueError) as e:
        check_tokenizers(_Vocab({"a": 0, "c": 1, "b": 2}), _Vocab(same), "t", "s")
    assert "(t, 3 tokens) differs from the policy's (s, 3 tokens), first at token id 1" in str(e.value)
    assert "('c' in the teacher's, 'b' in the policy's)" in str(e.value)


def _request(prompts, responses, top_k=0):
    return tpb.TeacherScoreRequest(
        sequences=[tpb.TeacherSequence(prompt_ids=p, response_ids=r) for p, r in zip(prompts, responses)],
        top_k=top_k,
    )


BAD = [
    ([], [], 0, "sequences", "empty batch"),
    ([[1, 4]], [[10**6]], 0, "sequences[0].response_ids", "token id 1000000 outside the vocabulary"),
    ([[1, -3]], [[4]], 0, "sequences[0].prompt_ids", "token id -3 outside the vocabulary"),
    ([[1, 4], [1]], [[4], [-1]], 0, "sequences[1].response_ids", "token id -1 outside"),
    ([[1, 4]], [[4]], 65, "top_k", "top_k: 65, expected in [0, "),
    ([[1, 4]], [[4]], -1, "top_k", "top_k: -1"),
    ([[]], [[4]], 0, "sequences[0].prompt_ids", "0 tokens, expected 1 to 32"),
    ([[1] * 33], [[4]], 0, "sequences[0].prompt_ids", "33 tokens, expected 1 to 32"),  # 2 x prompt_length
    ([[1, 4]], [[4] * 9], 0, "sequences[0].response_ids", "9 tokens, expected 0 to 8"),  # response_length
]


@pytest.mark.parametrize("prompts, responses, top_k, field, fragment", BAD)
def test_a_bad_request_is_invalid_argument_naming_its_field(served, prompts, responses, top_k, field, fragment):
    _, client = served
    with pytest.raises(grpc.RpcError) as e:
        client.stub.Score(_request(prompts, responses, top_k), metadata=client.metadata)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert fragment in e.value.details()
    assert [v.field for v in details_of(e.value).violations] == [field]
    assert client.score(PROMPTS[:1], RESPONSES[:1]).log_probs[0]  # still serving


def test_requests_past_the_rpc_limits_are_invalid_argument(cfg, teacher):
    small = on_free_ports(cfg, "teacher")
    small.rpc.max_prompts_per_request, small.rpc.max_request_tokens, small.rpc.max_message_mb = 300, 4000, 1
    with serve(small, teacher=teacher) as svc:
        client = TeacherClient(f"127.0.0.1:{svc.server.port}", cfg.rpc)
        score = lambda n, k, p=2: client.score([[1] * p] * n, [[4] * 8] * n, top_k=k)  # noqa: E731
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        expect_code(lambda: score(301, 0), invalid, "301 sequences, more than rpc.max_prompts_per_request=300")
        expect_code(lambda: score(300, 0, 8), invalid, "4800 token positions, more than rpc.max_request_tokens=4000")
        # 250 x 8 tokens x 64 entries: more than the 1 MiB an answer may take
        expect_code(lambda: score(250, 64), invalid, "more than rpc.max_message_mb=1")
        assert len(score(250, 1).top_ids) == 250  # the same request with a smaller top_k fits
        client.close()


def test_calls_need_the_bearer_token(served):
    svc, client = served
    channel = grpc.insecure_channel(f"127.0.0.1:{svc.server.port}")
    stub = teacher_pb2_grpc.TeacherStub(channel)
    unauthenticated = grpc.StatusCode.UNAUTHENTICATED
    expect_code(lambda: stub.Score(_request(PROMPTS, RESPONSES)), unauthenticated, "bearer")
    expect_code(
        lambda: stub.Info(tpb.TeacherInfoRequest(), metadata=(("authorization", "Bearer nope"),)), unauthenticated
    )
    channel.close()
    from services.common.rpc import health

    assert health.check(f"127.0.0.1:{svc.server.port}", "rlhf.v1.Teacher")  # probes need none


def test_a_workers_client_waits_for_a_restarted_teacher(cfg, teacher):
    """The teacher server goes away mid-run and comes back on its port: a client built by
    `teacher_client` (RideThrough, Tagged) says what it waits for, then gets its answer."""
    port = free_port()
    fixed = cfg.model_copy(deep=True)
    fixed.rpc.teacher.port, fixed.rpc.teacher.metrics_port = port, None
    fixed.rpc.retry_backoff_s, fixed.rpc.retry_max_backoff_s = 0.05, 0.2
    waits: list = []
    client = teacher_client(fixed, threading.Event(), waits.append)
    with serve(fixed, teacher=teacher):
        first = client.score(PROMPTS[:1], RESPONSES[:1])
        before = client.info().incarnation
    result: dict = {}
    caller = threading.Thread(target=lambda: result.setdefault("scores", client.score(PROMPTS[:1], RESPONSES[:1])))
    caller.start()
    wait_until(lambda: waits, "the call failing (the server is gone) and saying what it waits for")
    assert waits[-1].startswith(f"waiting for the teacher server at 127.0.0.1:{port} (UNAVAILABLE")
    with serve(fixed, teacher=teacher):
        caller.join(timeout=120)
        assert not caller.is_alive()
        assert client.info().incarnation != before
    assert torch.allclose(torch.tensor(result["scores"].log_probs[0]), torch.tensor(first.log_probs[0]))
    assert waits[-1] is None  # answered again
    client.close()


def test_a_failed_call_names_the_teacher(served, cfg):
    svc, _ = served
    here = cfg.model_copy(deep=True)
    here.rpc.teacher.port = svc.server.port
    client = teacher_client(here, threading.Event(), None)
    with pytest.raises(grpc.RpcError) as e:
        client.score([], [])  # refused: not repeated
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.service == "teacher"
    client.close()
