"""Weight updates in flight on vLLM's engine (its CPU build): a version loaded between two engine
steps, the requests in flight preempted and prefilled again under it (in_flight_cache: recompute);
every request completes, each token records the version that sampled it (the engine's DELTA
outputs), and the greedy tokens after the switch are what the new weights give from that prefix."""

import threading
import time

import pytest

from services.common.types import SamplingParams
from services.generation.backend import HFBackend
from tests.generation.test_in_flight import TEXTS, _after_switch, _new_weights
from tests.generation.test_vllm_backend import make_vllm

pytestmark = pytest.mark.vllm
T = 12


@pytest.fixture(scope="module")
def in_flight_backend(tiny_model_dir):
    b = make_vllm(tiny_model_dir, in_flight=True, recompute=True)
    yield b
    b.close()


def _with_an_update_at_step(b, new: dict, at: int, version: int, monkeypatch) -> list:
    """Patch the engine's step: after its `at`-th step, `update_weights(new, version)` is called
    from another thread and queued before the next step. Returns the updater's threads."""
    real_step, steps, threads = b.engine.step, [], []

    def step():
        out = real_step()
        steps.append(1)
        if len(steps) == at:
            t = threading.Thread(target=b.update_weights, args=(new, version))
            t.start()
            threads.append(t)
            deadline = time.monotonic() + 30
            while b._q.qsize() == 0 and time.monotonic() < deadline:  # the swap queued
                time.sleep(0.005)
        return out

    monkeypatch.setattr(b.engine, "step", step)
    return threads


def test_vllm_takes_an_update_between_steps(in_flight_backend, tiny_model_dir, monkeypatch):
    b = in_flight_backend
    hf = HFBackend(tiny_model_dir, "cpu")
    prompts = [hf.tokenizer(t)["input_ids"] for t in TEXTS]
    greedy = SamplingParams(n=2, temperature=0, max_new_tokens=T)
    before = b.generate(prompts, greedy)
    assert all(c.token_versions is None for cs in before.completions for c in cs)  # no update: one version
    new = _new_weights(hf)
    v = b.policy_version + 1
    threads = _with_an_update_at_step(b, new, 3, v, monkeypatch)
    res = b.generate(prompts, greedy)
    threads[0].join(60)
    assert b.policy_version == v and res.policy_version == v - 1
    hf.update_weights(new, 1)
    crossed = compared = 0
    for p, comps, old in zip(prompts, res.completions, before.completions):
        assert len(comps) == 2 and comps[0].token_ids == comps[1].token_ids  # greedy: one decoded, n returned
        c = comps[0]
        if c.token_versions is None:  # it ended before the switch
            assert c.token_ids == old[0].token_ids
            continue
        k = c.token_versions.index(v)
        assert c.token_versions == [v - 1] * k + [v] * (len(c.token_ids) - k) and k >= 1
        assert c.token_ids[:k] == old[0].token_ids[:k]  # before the switch: the old weights
        crossed += 1
        compared += _after_switch(hf, p, c.token_ids[:k], c.token_ids[k:])
    assert crossed >= 2 and compared >= 4
    # sampled, n=3: every request completes, log-probs and versions per token
    threads = _with_an_update_at_step(b, new, 2, v + 1, monkeypatch)
    res = b.generate(prompts, SamplingParams(n=3, temperature=1.0, max_new_tokens=T, seed=1))
    threads[0].join(60)
    for comps in res.completions:
        assert len(comps) == 3
        for c in comps:
            assert len(c.log_probs) == len(c.token_ids) > 0
            assert c.token_versions is None or len(c.token_versions) == len(c.token_ids)
    assert any(c.token_versions is not None for cs in res.completions for c in cs)
