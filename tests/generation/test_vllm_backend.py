"""The vllm backend directly (no server): a LoRA learner's merged policy loads into the running
engine like any other, and the engine's parameter specs are the learner's state dict."""

import pytest
import torch

from services.common.config import config_from_dict
from services.common.modeling import response_log_probs
from services.common.token_batch import build_token_batch
from services.common.types import SamplingParams
from services.generation.backend import HFBackend
from services.learner.trainer import PolicyTrainer
from tests.generation.test_server import VLLM_CPU

pytestmark = pytest.mark.vllm


def make_vllm(model_dir, **kw):
    """A vLLM backend on this CPU (vLLM's CPU build) for the tiny model, float32; `kw` its options."""
    from services.generation.vllm_backend import VLLMBackend

    vcfg = config_from_dict({"generation": {"vllm": VLLM_CPU}}).generation.vllm
    return VLLMBackend(model_dir, vcfg, dtype="float32", max_model_len=64, **kw)


@pytest.fixture(scope="module")
def vllm_backend(tiny_model_dir):
    b = make_vllm(tiny_model_dir)
    yield b
    b.close()


def _rollout(backend):
    from services.common.types import Rollout

    prompts = [backend.tokenizer(s)["input_ids"] for s in ["abc=", "hgfe=", "dada=", "bbcah="]]
    gen = backend.generate(prompts, SamplingParams(n=2, max_new_tokens=8, seed=0))
    rows = [(p, c) for p, cs in zip(prompts, gen.completions) for c in cs]
    return Rollout(
        [p for p, _ in rows],
        [c.token_ids for _, c in rows],
        [float(len(c.token_ids) % 3) for _, c in rows],
        [i // 2 for i in range(len(rows))],
        [c.log_probs for _, c in rows],
        None,
        [0] * len(rows),
    )


def test_lora_merged_policy_loads_and_serves_the_adapted_model(vllm_backend, tiny_model_dir):
    cfg = config_from_dict(
        {
            "model": {"path": tiny_model_dir, "device": "cpu", "lora": {"rank": 4}},
            "adv_estimator": "grpo",
            "num_return_sequences_in_group": 2,
            "actor_lr": 1e-2,
            "response_length": 8,
            "prompt_length": 16,
        }
    )
    learner = PolicyTrainer(cfg)
    learner.step(_rollout(vllm_backend))
    sd = learner.policy_state_dict()
    specs = vllm_backend.parameter_specs()
    assert {k: (tuple(v.shape), v.dtype) for k, v in sd.items()} == specs
    vllm_backend.update_weights(sd, vllm_backend.policy_version + 1)
    # what the engine samples now is the adapted policy's: greedy equals the merged model's, and
    # sampled log-probs equal the LoRA learner's recomputation
    reference = HFBackend(tiny_model_dir, "cpu")
    reference.update_weights(sd, 1)
    prompts = [vllm_backend.tokenizer(s)["input_ids"] for s in ["abcd=", "hgf=", "bab="]]
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    assert [c[0].token_ids for c in vllm_backend.generate(prompts, greedy).completions] == [
        c[0].token_ids for c in reference.generate(prompts, greedy).completions
    ]
    res = vllm_backend.generate(prompts, SamplingParams(n=3, temperature=0.8, max_new_tokens=8, seed=2))
    assert res.policy_version == vllm_backend.policy_version
    rows = [(p, c) for p, cs in zip(prompts, res.completions) for c in cs]
    learner.temperature = 0.8
    with torch.no_grad():
        lp = response_log_probs(
            learner.policy, build_token_batch([p for p, _ in rows], [c.token_ids for _, c in rows], 0), 0.8
        )["log_probs"]
    worst = max(abs(lp[i, j].item() - x) for i, (_, c) in enumerate(rows) for j, x in enumerate(c.log_probs))
    assert worst < 1e-4, worst


def test_a_swap_waits_for_requests_in_flight_and_later_ones_see_the_new_version(vllm_backend):
    """Calls queued behind a swap run after it; the calls already in flight finish before it."""
    import threading
    import time

    prompts = [[1, 4, 5, 6, 30]] * 16
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=8)
    v0 = vllm_backend.policy_version
    order = []
    first = vllm_backend.submit(prompts, params)
    swapped = threading.Event()

    def swap():  # stands in for a weight swap: it moves the version on
        order.append(("swap", first.done()))
        vllm_backend.policy_version += 1
        swapped.set()

    t = threading.Thread(target=lambda: vllm_backend.call(swap))
    t.start()
    while not (vllm_backend._calls or swapped.is_set()):  # the swap is queued (or already done)
        time.sleep(0.001)
    later = vllm_backend.submit(prompts, params)
    t.join(60)
    assert swapped.is_set() and order == [("swap", True)]  # the batch in flight had finished first
    assert first.result().policy_version == v0 and later.result().policy_version == v0 + 1


def test_an_engine_that_fails_midway_through_a_reload_serves_nothing(vllm_backend, tiny_model_dir, monkeypatch):
    """Every check passed and vLLM's reload still raised: the engine may hold a half-loaded policy,
    so it answers UNAVAILABLE (the pusher and the rollout workers go elsewhere) instead of
    sampling from it under the old version number."""
    from services.common.model_files import load_causal_lm
    from services.common.rpc.errors import Unavailable

    state = load_causal_lm(tiny_model_dir).state_dict()
    v = vllm_backend.policy_version

    def fail(*a, **kw):
        raise RuntimeError("device lost")

    monkeypatch.setattr(vllm_backend.engine, "collective_rpc", fail)
    try:
        with pytest.raises(RuntimeError, match="device lost"):
            vllm_backend.update_weights(state, v + 1)
        assert vllm_backend.policy_version == v
        with pytest.raises(Unavailable, match=f"failed while loading policy version {v + 1}"):
            vllm_backend.generate([[1, 4, 5, 30]], SamplingParams(max_new_tokens=2))
    finally:
        vllm_backend.broken = None
