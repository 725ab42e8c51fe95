"""`tinker.generation`: the Tinker API samples through a real generation server of its own (gRPC over
loopback, the hf backend on the tiny model), through the official SDK: the samples carry the
log-probs a plain forward gives, answered while the compute thread trains; a trained model's
sampler weights are pushed there (a partial push of the LoRA-merged layers), its greedy answer is
the one `rlhf eval` reads from the saved weights, and the base sampler gets the base back; a
restarted generation server gets the sampler's weights again; another writer's push is refused
with a sentence; a server that takes whole policies only (as vLLM's) gets the base with the
weights over it; a server that cannot serve the API is refused at start."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import tinker
from tinker import types

from services.cli.eval_model import tinker_checkpoint
from services.common.config import config_from_dict
from services.common.model_files import load_causal_lm
from services.common.types import SamplingParams
from services.generation.backend import HFBackend
from services.generation.policy import load_policy
from services.generation.server import serve as serve_generation
from services.tinker.decoders import OverGrpc
from services.tinker.server import serve
from tests.generation.test_server import backend_cfg
from tests.grpc_helpers import TOKEN, on_free_ports
from tests.tinker.test_tinker_api import KEY, _cfg, _datum, _plain_log_probs

GREEDY = types.SamplingParams(max_tokens=6, temperature=0.0)


def _gen_cfg(cfg, response_length: int = 16):
    """A generation server's config with room for what the API samples (16 new tokens)."""
    out = on_free_ports(cfg, "generation")
    out.response_length = response_length
    return out


@pytest.fixture(scope="module")
def generation(cfg, tiny_model_dir):
    with serve_generation(_gen_cfg(cfg), backend=HFBackend(tiny_model_dir, "cpu")) as svc:
        svc.address = f"127.0.0.1:{svc.server.port}"
        yield svc


def _api_cfg(tiny_model_dir, root, address: str, **tinker):
    base = _cfg(tiny_model_dir, root).model_dump()
    base["tinker"] = {**base["tinker"], "generation": address, **tinker}
    return config_from_dict(base)


@pytest.fixture(scope="module")
def api(tiny_model_dir, tmp_path_factory, generation):
    svc = serve(_api_cfg(tiny_model_dir, tmp_path_factory.mktemp("tinker"), generation.address)).start()
    svc.url = f"http://127.0.0.1:{svc.port}"
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def client(api):
    with tinker.ServiceClient(base_url=api.url, api_key=KEY) as sc:
        yield sc


def _greedy(sampler, prompt):
    return sampler.sample(types.ModelInput.from_ints(prompt), 1, GREEDY).result().sequences[0]


def test_samples_are_the_generation_servers_with_a_plain_forwards_log_probs(
    client, generation, tok, tiny_model_dir, monkeypatch
):
    model = load_causal_lm(tiny_model_dir).eval()
    backend, calls = generation.servicer.backend, []
    real = backend.generate

    def counting(prompts, *args, **kwargs):
        calls.append(len(prompts))
        return real(prompts, *args, **kwargs)

    monkeypatch.setattr(backend, "generate", counting)
    sc = client.create_sampling_client(base_model="tiny").result()
    prompt = tok.encode("abc=")
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=0)
    res = sc.sample(types.ModelInput.from_ints(prompt), num_samples=3, sampling_params=params).result()
    assert len(res.sequences) == 3 and calls == [1]  # decoded by the generation server
    for seq in res.sequences:
        assert 1 <= len(seq.tokens) <= 8 and len(seq.logprobs) == len(seq.tokens)
        np.testing.assert_allclose(seq.logprobs, _plain_log_probs(model, prompt, seq.tokens), atol=1e-4)
    scored = sc.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    assert scored[0] is None
    np.testing.assert_allclose(scored[1:], _plain_log_probs(model, prompt[:1], prompt[1:]), atol=1e-4)


def test_a_sample_is_answered_while_the_compute_thread_trains(client, api, tok):
    """Decoded by the generation server, a sample takes no turn of the compute thread: it is
    answered while other work (a training request's) holds that thread."""
    sc = client.create_sampling_client(base_model="tiny").result()
    held, release, released = threading.Event(), threading.Event(), threading.Event()

    def hold():
        held.set()
        release.wait(120)
        released.set()

    api.api.compute.submit(hold)
    try:
        assert held.wait(60)
        seq = _greedy(sc, tok.encode("abc="))
        assert not released.is_set(), "the sample waited for the compute thread"
    finally:
        release.set()
    assert 1 <= len(seq.tokens) == len(seq.logprobs) <= 6


def test_trained_weights_are_pushed_there_and_the_base_comes_back(client, api, generation, tok, tiny_model_dir):
    prompt = tok.encode("hello=")
    base = client.create_sampling_client(base_model="tiny").result()
    before = _greedy(base, prompt)
    tc = client.create_lora_training_client(base_model="tiny", rank=8, seed=1).result()
    batch = [_datum(tok, "hello=zzzzzz")]
    for _ in range(3):
        tc.forward_backward(batch, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
    version = generation.servicer.backend.policy_version
    path = tc.save_weights_for_sampler("step3").result().path
    trained = client.create_sampling_client(model_path=path).result()
    after = _greedy(trained, prompt)
    assert generation.servicer.backend.policy_version == version + 1  # one push for it
    assert after.tokens != before.tokens or not np.allclose(after.logprobs, before.logprobs, atol=1e-3)
    # what `rlhf eval --model tinker://...` loads from the saved file samples the same
    evaluated = load_policy(tinker_checkpoint(api.cfg, "--model", path), tiny_model_dir)
    out = evaluated.generate([prompt], SamplingParams(n=1, temperature=0.0, max_new_tokens=6))
    assert list(out.completions[0][0].token_ids) == after.tokens
    np.testing.assert_allclose(after.logprobs, out.completions[0][0].log_probs, atol=1e-4)
    # the base sampler again: the replaced layers go back
    again = _greedy(base, prompt)
    assert again.tokens == before.tokens and np.allclose(again.logprobs, before.logprobs, atol=1e-5)


def test_a_restarted_generation_server_gets_the_weights_again(client, api, cfg, tok, tiny_model_dir, tmp_path):
    """The API's server replaced by a fresh one on the same port (the base weights, version 0): the
    trained sampler's next sample pushes its weights again and samples what it sampled before."""
    gen_cfg = _gen_cfg(cfg)
    first = serve_generation(gen_cfg, backend=HFBackend(tiny_model_dir, "cpu")).__enter__()
    port = first.server.port
    svc = serve(_api_cfg(tiny_model_dir, tmp_path, f"127.0.0.1:{port}")).start()
    second = None
    try:
        with tinker.ServiceClient(base_url=f"http://127.0.0.1:{svc.port}", api_key=KEY) as sc:
            tc = sc.create_lora_training_client(base_model="tiny", rank=8, seed=2).result()
            tc.forward_backward([_datum(tok, "abc=qqqqqq")], "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
            sampler = tc.save_weights_and_get_sampling_client()
            prompt = tok.encode("abc=")
            trained = _greedy(sampler, prompt)
            first.__exit__(None, None, None)
            gen_cfg.rpc.generation.port = port
            second = serve_generation(gen_cfg, backend=HFBackend(tiny_model_dir, "cpu")).__enter__()
            assert second.servicer.backend.policy_version == 0
            again = _greedy(sampler, prompt)
            assert again.tokens == trained.tokens
            np.testing.assert_allclose(again.logprobs, trained.logprobs, atol=1e-5)
            assert second.servicer.backend.policy_version == 1
            # another writer pushes to it: the API says so instead of sampling foreign weights
            model = load_causal_lm(tiny_model_dir)
            state = {"model.norm.weight": model.state_dict()["model.norm.weight"]}
            second.servicer.backend.update_weights(state, 5)
            with pytest.raises(Exception, match="another writer"):
                _greedy(sampler, prompt)
    finally:
        svc.stop()
        for s in (first, second):
            if s is not None:
                s.__exit__(None, None, None)


def test_a_generation_server_that_cannot_serve_the_api_is_refused_at_start(cfg, tiny_model_dir, tmp_path):
    small = _gen_cfg(cfg, response_length=4)
    with serve_generation(small, backend=HFBackend(tiny_model_dir, "cpu")) as svc:
        api_cfg = _api_cfg(tiny_model_dir, tmp_path, f"127.0.0.1:{svc.server.port}")
        with pytest.raises(ValueError, match="response_length 4 is under the 16 new tokens"):
            OverGrpc(api_cfg, api_cfg.tinker.generation)


def test_the_token_is_the_one_configured(tiny_model_dir, tmp_path, generation):
    """The API dials its generation server with rpc.auth_token: a wrong one is refused at start."""
    wrong = _api_cfg(tiny_model_dir, tmp_path, generation.address)
    wrong.rpc.auth_token = TOKEN + "x"
    with pytest.raises(ValueError, match="UNAUTHENTICATED"):
        OverGrpc(wrong, wrong.tinker.generation)


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_a_server_that_takes_whole_policies_gets_the_base_with_the_weights_over_it(
    cfg, client, api, tok, tiny_model_dir, engine
):
    """As a vLLM server is pushed to (no partial versions; the hf backend told to take whole
    policies only, and the real vLLM engine): the same sampler weights, pushed whole, sample what
    the partial push sampled. A second API on the same tinker.root reads the saved file."""
    prompt = tok.encode("hello=")
    path = _saved(client, tok)
    partial = _greedy(client.create_sampling_client(model_path=path).result(), prompt)
    if engine == "hf":
        backend = HFBackend(tiny_model_dir, "cpu")
        backend.partial_updates = False  # type: ignore[misc]
        server = serve_generation(_gen_cfg(cfg), backend=backend)
    else:
        server = serve_generation(_gen_cfg(backend_cfg(cfg, "vllm")))
    with server as gen:
        svc = serve(_api_cfg(tiny_model_dir, api.cfg.tinker.root, f"127.0.0.1:{gen.server.port}")).start()
        try:
            assert svc.api.engine.decoder.partial is False
            with tinker.ServiceClient(base_url=f"http://127.0.0.1:{svc.port}", api_key=KEY) as sc:
                whole = _greedy(sc.create_sampling_client(model_path=path).result(), prompt)
                base = _greedy(sc.create_sampling_client(base_model="tiny").result(), prompt)
        finally:
            svc.stop()
    assert whole.tokens == partial.tokens
    np.testing.assert_allclose(whole.logprobs, partial.logprobs, atol=1e-4)
    assert base.tokens != whole.tokens or not np.allclose(base.logprobs, whole.logprobs, atol=1e-3)


def _saved(client, tok) -> str:
    """A LoRA model trained three steps toward "hello=zzzzzz", its sampler weights saved by name."""
    tc = client.create_lora_training_client(base_model="tiny", rank=8, seed=3).result()
    for _ in range(3):
        tc.forward_backward([_datum(tok, "hello=zzzzzz")], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
    return tc.save_weights_for_sampler("whole").result().path


def test_an_api_started_on_a_server_with_other_weights_pushes_the_whole_base(
    client, generation, tok, tiny_model_dir, tmp_path
):
    """The module's server holds a trained sampler's weights (pushed by the module's API) when a
    new API starts on it: not knowing what it serves, the new API's first push is the whole base,
    so its base sampler samples the base. (Last in the module: the old API then finds a version it
    did not push, and says so.)"""
    prompt = tok.encode("hello=")
    _greedy(client.create_sampling_client(model_path=_saved(client, tok)).result(), prompt)
    assert generation.servicer.backend.policy_version > 0
    plain = HFBackend(tiny_model_dir, "cpu").generate([prompt], SamplingParams(n=1, temperature=0.0, max_new_tokens=6))
    want = plain.completions[0][0]
    fresh = serve(_api_cfg(tiny_model_dir, tmp_path, generation.address)).start()
    try:
        with tinker.ServiceClient(base_url=f"http://127.0.0.1:{fresh.port}", api_key=KEY) as sc:
            base = _greedy(sc.create_sampling_client(base_model="tiny").result(), prompt)
    finally:
        fresh.stop()
    assert base.tokens == list(want.token_ids)
    np.testing.assert_allclose(base.logprobs, want.log_probs, atol=1e-5)
    with pytest.raises(Exception, match="another writer"):
        _greedy(client.create_sampling_client(base_model="tiny").result(), prompt)


def test_the_base_a_push_puts_back_is_read_from_the_files_not_held(api, tiny_model_dir):
    """The base tensors a push restores come from model.path's safetensors when asked: equal to
    the model's own, and no copy of the base model stays in the API's process."""
    import torch

    decoder = api.api.engine.decoder
    loaded = load_causal_lm(tiny_model_dir).state_dict()
    names = {"model.layers.0.mlp.up_proj.weight", "lm_head.weight"}
    got = decoder.base(names)
    assert set(got) == names and all(torch.equal(got[n], loaded[n]) for n in names)
    assert set(decoder.base()) == set(loaded)
    assert decoder._base is None
