"""`rlhf serve tinker` through the official `tinker` SDK, unchanged, over real HTTP, on the tiny
model: a step lowers the cross-entropy of its batch; samples carry the log-probs a plain forward
of the model gives their tokens; a trained model's sampler weights sample what it says; a retried
optim_step is applied once; after a restart an optim_step is refused (its gradients are gone)
while a saved state loads back; bad requests are 4xx in the one error shape, never 5xx."""

from __future__ import annotations

import json
import math
import threading
import time

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types
from tinker.proto import request_conv

from services.cli.eval_model import tinker_checkpoint
from services.common.config import config_from_dict
from services.common.model_files import load_causal_lm
from services.common.types import SamplingParams
from services.generation.policy import load_policy
from services.tinker.server import serve
from tests.grpc_helpers import TOKEN

KEY = f"tml-{TOKEN}"
PROTO = {"Content-Type": "application/x-protobuf"}


def _cfg(model_dir: str, root, port: int = 0):
    return config_from_dict(
        {
            "model": {"path": model_dir, "device": "cpu"},
            "prompt_length": 32,
            "response_length": 16,
            "rpc": {"auth_token": TOKEN},
            "tinker": {
                "port": port,
                "root": str(root),
                "model_name": "tiny",
                "max_datums": 8,
                "poll_hold_s": 5,
                "max_models": 8,
            },
        }
    )


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    svc = serve(_cfg(tiny_model_dir, tmp_path_factory.mktemp("tinker"))).start()
    svc.url = f"http://127.0.0.1:{svc.port}"
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def client(server):
    with tinker.ServiceClient(base_url=server.url, api_key=KEY) as sc:
        yield sc


@pytest.fixture(scope="module")
def raw(server):
    with httpx.Client(base_url=f"{server.url}/api/v1", headers={"X-API-Key": KEY}, timeout=60) as c:
        yield c


def _datum(tok, text: str, weight: float = 1.0) -> types.Datum:
    """`text` as a next-token datum: its tokens but the last in, each next token the target."""
    ids = tok.encode(text)
    target = ids[1:]
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": target, "weights": [weight] * len(target)},
    )


def _loss(tc, batch) -> float:
    return tc.forward(batch, "cross_entropy").result().metrics["loss:sum"]


def _plain_log_probs(model, prompt: list[int], tokens: list[int]) -> np.ndarray:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0]
    return np.array([float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)])


def _proto(model_id: str, seq_id: int, data, loss_fn: str = "cross_entropy") -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy", loss_fn_config=None),
        model_id=model_id,
        seq_id=seq_id,
    )
    msg = request_conv.forward_backward_request_to_proto(request)
    msg.loss_fn = loss_fn
    return msg.SerializeToString()


def _json(obj) -> bytes:
    """JSON with NaN as JavaScript writes it (httpx's json= refuses NaN)."""
    return json.dumps(obj).encode()


def _refused(r: httpx.Response, status: int, words: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and words in error["message"], error
    return error


def test_a_step_lowers_the_cross_entropy_of_its_batch(client, tok, tiny_model_dir):
    tc = client.create_lora_training_client(base_model="tiny", rank=8, seed=0).result()
    info = tc.get_info()
    assert info.model_data.model_name == "tiny" and info.is_lora and info.lora_rank == 8
    assert tc.get_tokenizer().encode("abc=") == tok.encode("abc=")  # tokenizer_id: the local directory
    batch = [_datum(tok, "abc=cba"), _datum(tok, "hello=olleh")]
    before = _loss(tc, batch)
    out = tc.forward_backward(batch, "cross_entropy").result()
    logprobs = [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]
    assert [len(x) for x in logprobs] == [len(d.model_input.to_ints()) for d in batch]
    assert math.isclose(out.metrics["loss:sum"], before, rel_tol=1e-5)
    assert math.isclose(-sum(float(x.sum()) for x in logprobs), before, rel_tol=1e-5)
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    after = _loss(tc, batch)
    assert after < before, (before, after)
    # per-token weights: a datum weighted 0 everywhere adds nothing
    zero = _datum(tok, "abc=cba", 0.0)
    assert math.isclose(_loss(tc, [zero, batch[1]]), _loss(tc, batch[1:]), rel_tol=1e-5)


def test_the_rl_losses_reach_the_server_as_the_sdk_sends_them(client, tok):
    """dro and gspo through the SDK: the loss is the formula over the log-probs it returns (the
    sampler's taken as the model's own minus 0.1, so gspo's ratio, e^0.1, is clipped)."""
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    ids = tok.encode("abc=cba")
    plain = _datum(tok, "abc=cba")
    own = tc.forward([plain], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    n = len(own)
    adv = np.array([0.0] + [1.0] * (n - 1), dtype=np.float32)  # the first position is the prompt's
    q = (own - 0.1).astype(np.float32)
    inputs = {"target_tokens": ids[1:], "logprobs": q, "advantages": adv}
    dro = types.Datum(model_input=plain.model_input, loss_fn_inputs=inputs)
    out = tc.forward([dro], "dro", {"beta": 0.5}).result()
    logp = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    expected = -float((logp * adv - 0.25 * (logp - q) ** 2).sum())
    assert math.isclose(out.metrics["loss:sum"], expected, rel_tol=1e-4)
    mask = {"sequence_ratio_mask": (adv != 0).astype(np.float32)}
    gspo = types.Datum(model_input=plain.model_input, loss_fn_inputs={**inputs, **mask})
    out = tc.forward_backward([gspo], "gspo").result()
    assert math.isclose(out.metrics["loss:sum"], -(1 + 4e-4) * (n - 1), rel_tol=1e-4)


def test_samples_carry_the_log_probs_a_plain_forward_gives(client, tok, tiny_model_dir):
    model = load_causal_lm(tiny_model_dir).eval()
    sc = client.create_sampling_client(base_model="tiny").result()
    prompt = tok.encode("abc=")
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=0)
    res = sc.sample(types.ModelInput.from_ints(prompt), num_samples=3, sampling_params=params).result()
    assert len(res.sequences) == 3
    for seq in res.sequences:
        assert 1 <= len(seq.tokens) <= 8 and len(seq.logprobs) == len(seq.tokens)
        np.testing.assert_allclose(seq.logprobs, _plain_log_probs(model, prompt, seq.tokens), atol=1e-4)
    scored = sc.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    assert scored[0] is None
    np.testing.assert_allclose(scored[1:], _plain_log_probs(model, prompt[:1], prompt[1:]), atol=1e-4)


def test_sample_requests_queued_together_decode_in_one_batch(client, server, tok, monkeypatch):
    """Eight requests sent while the compute thread is busy: one generate call decodes them all."""
    sc = client.create_sampling_client(base_model="tiny").result()
    backend, calls = server.api.engine.decoder.backend, []
    real = backend.generate

    def counting(prompts, params, *args, **kwargs):
        calls.append(len(prompts))
        return real(prompts, params, *args, **kwargs)

    monkeypatch.setattr(backend, "generate", counting)
    busy = threading.Event()
    server.api.compute.submit(busy.wait, 60)
    try:
        params = types.SamplingParams(max_tokens=4, temperature=1.0)
        words = ["abc", "hello", "xy", "pqrs", "a", "bb", "ccc", "dddd"]
        futures = [sc.sample(types.ModelInput.from_ints(tok.encode(f"{w}=")), 2, params) for w in words]
        deadline = time.monotonic() + 60
        while len(server.api.batches._pending) < len(words) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        busy.set()
    results = [f.result() for f in futures]
    assert calls == [len(words)]
    assert all(len(r.sequences) == 2 and all(1 <= len(s.tokens) <= 4 for s in r.sequences) for r in results)


def test_a_trained_models_sampler_weights_sample_what_it_says(client, server, tok, tiny_model_dir):
    prompt = tok.encode("hello=")
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0)
    base = client.create_sampling_client(base_model="tiny").result()
    before = base.sample(types.ModelInput.from_ints(prompt), 1, greedy).result().sequences[0]
    tc = client.create_lora_training_client(base_model="tiny", rank=8, seed=1).result()
    batch = [_datum(tok, "hello=zzzzzz")]
    for _ in range(3):
        tc.forward_backward(batch, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
    trained = tc.save_weights_and_get_sampling_client()
    after = trained.sample(types.ModelInput.from_ints(prompt), 1, greedy).result().sequences[0]
    assert after.tokens != before.tokens or not np.allclose(after.logprobs, before.logprobs, atol=1e-3)
    # the trained model's own log-probs of what its sampler picked
    scored = types.Datum(
        model_input=types.ModelInput.from_ints(prompt + after.tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": prompt[1:] + after.tokens,
            "weights": [1.0] * (len(prompt) + len(after.tokens) - 1),
        },
    )
    own = tc.forward([scored], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(after.logprobs, own[len(prompt) - 1 :], atol=1e-4)
    # saved by name: a sampler from the file samples the same; the base sampler still samples the base
    path = tc.save_weights_for_sampler("step3").result().path
    assert path.endswith("/sampler_weights/step3")
    named = client.create_sampling_client(model_path=path).result()
    assert named.sample(types.ModelInput.from_ints(prompt), 1, greedy).result().sequences[0].tokens == after.tokens
    again = base.sample(types.ModelInput.from_ints(prompt), 1, greedy).result().sequences[0]
    assert again.tokens == before.tokens and np.allclose(again.logprobs, before.logprobs, atol=1e-5)
    # `rlhf eval --model tinker://...` finds the file under tinker.root and loads it over the base
    found = tinker_checkpoint(server.cfg, "--model", path)
    evaluated = load_policy(found, tiny_model_dir)
    out = evaluated.generate([prompt], SamplingParams(n=1, temperature=0.0, max_new_tokens=6))
    assert list(out.completions[0][0].token_ids) == after.tokens
    with pytest.raises(ValueError, match="no checkpoint"):
        tinker_checkpoint(server.cfg, "--model", path.replace("step3", "nothing"))
    with pytest.raises(ValueError, match="this takes sampler_weights"):
        tinker_checkpoint(server.cfg, "--model", path.replace("sampler_weights", "weights"))


def test_a_retried_optim_step_is_applied_once(client, server, raw, tok):
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=2).result()
    model_id = tc.get_info().model_id
    tc.forward_backward([_datum(tok, "abc=cba")], "cross_entropy").result()  # seq_id 1
    held = server.api.models[model_id].model
    body = {"model_id": model_id, "seq_id": 2, "type": "optim_step", "adam_params": {"learning_rate": 0.01}}
    first = raw.post("/optim_step", json=body, headers={"X-Idempotency-Key": "k1"}).json()
    assert raw.post("/optim_step", json=body, headers={"X-Idempotency-Key": "k1"}).json() == first
    assert raw.post("/optim_step", json=body, headers={"X-Idempotency-Key": "k2"}).json() == first  # same seq_id
    done = raw.post("/retrieve_future", json={"request_id": first["request_id"]}).json()
    assert done["metrics"]["step:max"] == 1.0 and done["metrics"]["datums:sum"] == 1.0
    weights = {n: p.detach().clone() for n, p in held.policy.named_parameters() if p.requires_grad}
    assert raw.post("/optim_step", json=body).json() == first  # replayed after it ran: its stored result
    assert raw.post("/retrieve_future", json={"request_id": first["request_id"]}).json() == done
    assert held.steps == 1
    assert all(torch.equal(p, weights[n]) for n, p in held.policy.named_parameters() if p.requires_grad)
    other = {**body, "adam_params": {"learning_rate": 0.5}}
    assert _refused(raw.post("/optim_step", json=other), 400, "already used")["code"] == "seq_id_reused"
    _refused(raw.post("/optim_step", json=other, headers={"X-Idempotency-Key": "k1"}), 400, "Idempotency-Key")


def test_after_a_restart_optim_step_is_refused_and_a_saved_state_loads(tiny_model_dir, tmp_path, tok):
    root = tmp_path / "tinker"
    first = serve(_cfg(tiny_model_dir, root)).start()
    url = f"http://127.0.0.1:{first.port}"
    batch = [_datum(tok, "abc=cba")]
    sc = tinker.ServiceClient(base_url=url, api_key=KEY)
    tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    tc.forward_backward(batch, "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=0.05))
    saved = tc.save_state("step1").result().path
    loss = _loss(tc, batch)
    tc.forward_backward(batch, "cross_entropy").result()  # gradients that the restart loses
    model_id = tc.get_info().model_id
    first.stop()
    second = serve(_cfg(tiny_model_dir, root, first.port)).start()
    try:
        with httpx.Client(base_url=f"{url}/api/v1", headers={"X-API-Key": KEY}) as raw:
            body = {"model_id": model_id, "seq_id": 6, "adam_params": {"learning_rate": 0.01}}
            error = _refused(raw.post("/optim_step", json=body), 400, "has no gradients to step with")
            assert error["code"] == "server_restarted" and "create_training_client_from_state" in error["message"]
        with pytest.raises(Exception, match="half a step"):
            tc.optim_step(types.AdamParams(learning_rate=0.01)).result()
        sc.close("success").result()  # its session went with the first process: finishing it is no error
        with tinker.ServiceClient(base_url=url, api_key=KEY) as again:
            loaded = again.create_training_client_from_state_with_optimizer(saved).result()
            assert math.isclose(_loss(loaded, batch), loss, rel_tol=1e-5)
    finally:
        second.stop()


def test_bad_requests_are_4xx_in_one_shape(client, server, raw, tok):
    tc = client.create_lora_training_client(base_model="tiny", rank=4).result()
    model_id = tc.get_info().model_id
    url = f"{server.url}/api/v1"
    _refused(httpx.post(f"{url}/create_session", json={}), 401, "API key")
    _refused(httpx.post(f"{url}/create_session", json={}, headers={"X-API-Key": "tml-wrong"}), 401, "API key")
    assert httpx.get(f"{url}/healthz").status_code == 200  # the one open path
    good = [_datum(tok, "abc=cba")]
    unknown = _refused(
        raw.post("/forward_backward", content=_proto(model_id, 1, good, "nonsense"), headers=PROTO), 400, ""
    )
    assert "cross_entropy, importance_sampling, ppo, cispo, dro, gspo" in unknown["message"]
    assert unknown["param"] == "loss_fn"
    with pytest.raises(Exception, match="not supported"):  # the SDK's client too (which it then poisons)
        tc.forward_backward(good, "stable_reinforce").result()
    nan = [_datum(tok, "abc=cba", float("nan"))]
    _refused(raw.post("/forward_backward", content=_proto(model_id, 1, nan), headers=PROTO), 400, "NaN")
    outside = [
        types.Datum(model_input=types.ModelInput.from_ints([1, 10**6]), loss_fn_inputs={"target_tokens": [2, 3]})
    ]
    _refused(raw.post("/forward_backward", content=_proto(model_id, 1, outside), headers=PROTO), 400, "vocabulary")
    _refused(raw.post("/forward_backward", content=_proto(model_id, 1, good * 9), headers=PROTO), 400, "9 datums")
    _refused(raw.post("/forward_backward", content=b"\xff\x00garbage", headers=PROTO), 400, "protobuf")
    lr_nan = {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": float("nan")}}
    _refused(raw.post("/optim_step", content=_json(lr_nan)), 400, "learning_rate")
    _refused(raw.post("/optim_step", json={"model_id": model_id, "seq_id": 2**40}), 400, "seq_id")
    _refused(
        raw.post("/create_model", json={"session_id": "x", "model_seq_id": 0, "base_model": "tiny"}), 404, "session"
    )
    _refused(
        raw.post("/save_weights", json={"model_id": model_id, "seq_id": 1, "path": "../../etc"}), 400, "plain name"
    )
    bad_path = {"session_id": "x", "model_seq_id": 0, "path": "tinker://../weights/x", "optimizer": False}
    _refused(raw.post("/load_weights", json=bad_path), 400, "plain name")
    sample = {
        "sampling_session_id": "nope",
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
        "sampling_params": {"max_tokens": 4},
    }
    _refused(raw.post("/asample", json=sample), 404, "no sampling session")
    _refused(raw.post("/retrieve_future", json={"request_id": "nope"}), 404, "no request")
    # none of that touched the model: its seq_id 1 is still free, and a good request runs
    queued = raw.post("/forward_backward", content=_proto(model_id, 1, good), headers=PROTO).json()
    done = raw.post("/retrieve_future", json={"request_id": queued["request_id"]})
    assert done.status_code == 200 and done.headers["content-type"] == "application/x-protobuf"


POSTS = [
    "create_session",
    "session_heartbeat",
    "create_model",
    "get_info",
    "forward_backward",
    "optim_step",
    "save_weights",
    "save_weights_for_sampler",
    "load_weights",
    "create_sampling_session",
    "asample",
    "retrieve_future",
]
MALFORMED = [b"", b"[]", b"null", b'"x"', b"{bad", b'{"model_id": 1, "seq_id": 1e400}', b"\xff\x00garbage"]


def test_no_malformed_body_is_a_5xx(raw):
    """Every POST path, every malformed body, as JSON and as protobuf: a 4xx in the one shape (but
    create_session, which asks for nothing: any object, an empty body too, makes a session)."""
    for path in POSTS:
        for body in MALFORMED:
            for kind in ("application/json", PROTO["Content-Type"]):
                r = raw.post(f"/{path}", content=body, headers={"Content-Type": kind})
                refused = 400 <= r.status_code < 500 and r.json()["error"]["message"]
                assert refused or (path == "create_session" and r.status_code == 200), (path, body, kind, r.text)


def test_metrics_count_the_requests_and_the_work_behind_the_key(tiny_model_dir, tmp_path, tok):
    """GET /metrics: Prometheus' text behind the API key (401 without it), every answered request
    counted by its route (a path parameter as its name: no label per id, an unknown path "other"),
    the compute thread's work by kind, and what the API holds now."""
    svc = serve(_cfg(tiny_model_dir, tmp_path)).start()
    url = f"http://127.0.0.1:{svc.port}"
    try:
        with tinker.ServiceClient(base_url=url, api_key=KEY) as sc:
            tc = sc.create_lora_training_client(base_model="tiny", rank=4)
            tc.forward_backward([_datum(tok, "12 + 30 = 42")], "cross_entropy").result()
            text = _scrape(url)
    finally:
        svc.stop()
    assert 'rlhf_http_requests_total{code="200",path="/api/v1/forward_backward",service="tinker"}' in text
    assert 'path="/api/v1/samplers/{sampler_id}"' in text and 'path="other"' in text
    assert "no-such-sampler" not in text
    assert 'rlhf_tinker_work_seconds_count{kind="forward_backward",service="tinker"}' in text
    models = next(line for line in text.splitlines() if line.startswith("rlhf_tinker_training_models{"))
    assert float(models.split()[-1]) == 1


def _scrape(url: str) -> str:
    """Two requests the label set must not grow by, then /metrics with the key (and without)."""
    with httpx.Client(base_url=url, timeout=30) as c:
        assert c.get("/metrics").status_code == 401
        c.get("/api/v1/samplers/no-such-sampler", headers={"X-API-Key": KEY})
        c.get("/not/a/route", headers={"X-API-Key": KEY})
        r = c.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return r.text
