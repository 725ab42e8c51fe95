"""Weight updates in flight (generation.weight_update: in_flight): a version that arrives while a
batch decodes is taken between two decoding steps; every request completes; each token records
the version that sampled it; with the cache recomputed, the greedy tokens after the switch are what
the new weights give from that prefix. With between_batches the update waits for the batch."""

import threading
import time

import pytest
import torch

import services.generation.decode as decode_mod
from services.common.config import ConfigError, config_from_dict
from services.common.types import SamplingParams
from services.generation.backend import HFBackend
from services.generation.batching import Batcher, make_batcher

TEXTS = ["abc=", "hgfed=", "ab=", "dcbahgfe="]
T = 12
SWITCH_AT = 3  # the switch comes after this many tokens


def _new_weights(b: HFBackend, scale: float = 0.05) -> dict:
    """The backend's weights plus seeded noise: another policy version."""
    g = torch.Generator().manual_seed(1)
    return {
        k: v.float() + scale * v.float().std().nan_to_num(0) * torch.randn(v.shape, generator=g)
        if v.is_floating_point()
        else v
        for k, v in b.model.state_dict().items()
    }


def _after_switch(b: HFBackend, prompt: list[int], before: list[int], after: list[int]) -> int:
    """Compare `after` with what b's (new) weights give greedily from prompt + before, step by
    step, up to the first near-tie (top two logits within 1e-3: another batch shape's rounding may
    flip it). Returns the number of tokens compared."""
    ctx = list(prompt) + list(before)
    for j, tok in enumerate(after):
        with torch.no_grad():
            logits = b.model(torch.tensor([ctx])).logits[0, -1].float()
        top2 = logits.topk(2)
        if top2.values[0] - top2.values[1] < 1e-3:
            return j
        assert tok == top2.indices[0].item(), (prompt, before, j)
        ctx.append(tok)
    return len(after)


@pytest.mark.parametrize("recompute", [True, False])
def test_an_update_between_steps_is_taken_and_recorded_per_token(tiny_model_dir, recompute):
    b = HFBackend(tiny_model_dir, "cpu", recompute=recompute)
    prompts = [b.tokenizer(t)["input_ids"] for t in TEXTS]
    params = SamplingParams(n=2, temperature=0, max_new_tokens=T)
    plain = b.generate(prompts, params)
    new = _new_weights(b)
    steps = []

    def between():
        steps.append(1)
        if len(steps) == SWITCH_AT:
            b.update_weights(new, 1)

    res = b.generate(prompts, params, between=between)
    assert res.policy_version == 0 and b.policy_version == 1
    crossed = compared = 0
    for p, comps, plain_comps in zip(prompts, res.completions, plain.completions):
        for c, old in zip(comps, plain_comps):
            assert c.finish_reason in ("stop", "length") and len(c.log_probs) == len(c.token_ids)
            assert c.token_ids[:SWITCH_AT] == old.token_ids[:SWITCH_AT]  # before the switch: the old weights
            if len(c.token_ids) <= SWITCH_AT:
                assert c.token_versions is None  # it ended before the switch: one version
                continue
            crossed += 1
            assert c.token_versions == [0] * SWITCH_AT + [1] * (len(c.token_ids) - SWITCH_AT)
            if recompute:
                compared += _after_switch(b, p, c.token_ids[:SWITCH_AT], c.token_ids[SWITCH_AT:])
    assert crossed >= 4  # most samples decode past the switch: not a vacuous check
    if recompute:
        assert compared >= 8


def _run_with_an_update_queued(batcher, b: HFBackend, new: dict, monkeypatch) -> tuple:
    """A batch decoding when a weight update is queued through `batcher.call` (from another thread,
    at the batch's third step); returns (the batch's result, the update's thread)."""
    real_pick, picks, threads = decode_mod.pick, [], []

    def pick(logits, params):
        picks.append(1)
        if len(picks) == 3:  # mid-batch: queue the update and wait until it is queued
            t = threading.Thread(target=batcher.call, args=(b.update_weights, new, 1), kwargs={"timeout": 60})
            t.start()
            threads.append(t)
            deadline = time.monotonic() + 30
            while batcher.q.qsize() == 0 and time.monotonic() < deadline:
                time.sleep(0.005)
            assert batcher.q.qsize() > 0
        return real_pick(logits, params)

    monkeypatch.setattr(decode_mod, "pick", pick)
    prompts = [b.tokenizer(t)["input_ids"] for t in TEXTS]
    res = batcher.start(prompts, SamplingParams(n=2, temperature=0, max_new_tokens=T)).result(60)
    threads[0].join(60)
    return res, threads[0]


def test_the_batcher_takes_a_queued_update_in_flight(tiny_model_dir, monkeypatch):
    b = HFBackend(tiny_model_dir, "cpu")
    batcher = Batcher(b, 64, 0.0, in_flight=True)
    try:
        res, t = _run_with_an_update_queued(batcher, b, _new_weights(b), monkeypatch)
    finally:
        batcher.close()
    assert not t.is_alive() and b.policy_version == 1
    versions = [c.token_versions for comps in res.completions for c in comps]
    assert res.policy_version == 0
    assert any(v is not None and v[0] == 0 and v[-1] == 1 for v in versions)  # switched mid-sample


def test_between_batches_the_update_waits_for_the_batch(tiny_model_dir, monkeypatch):
    b = HFBackend(tiny_model_dir, "cpu")
    batcher = Batcher(b, 64, 0.0)
    try:
        res, t = _run_with_an_update_queued(batcher, b, _new_weights(b), monkeypatch)
    finally:
        batcher.close()
    assert not t.is_alive() and b.policy_version == 1  # applied after the batch
    assert res.policy_version == 0
    assert all(c.token_versions is None for comps in res.completions for c in comps)


def test_the_setting_picks_the_batcher(tiny_model_dir):
    cfg = config_from_dict(
        {"model": {"path": tiny_model_dir, "device": "cpu"}, "generation": {"weight_update": "in_flight"}}
    )
    b = HFBackend(tiny_model_dir, "cpu")
    batcher = make_batcher(b, cfg)
    try:
        assert isinstance(batcher, Batcher) and batcher.in_flight
    finally:
        batcher.close()
    with pytest.raises(ConfigError, match="weight_update"):
        config_from_dict({"generation": {"weight_update": "midway"}})
