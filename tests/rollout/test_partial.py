"""Partial rollouts (rollout.partial_tokens, services/training/partial.py): a response paused at a
budget of new tokens and resumed from its tokens so far is, under greedy decoding, the one decoded
without a pause; every token keeps the version that sampled it; a rollout worker's continuations
reach a real generation server over gRPC; off (0), nothing changes."""

from __future__ import annotations

import threading

import pytest
import torch

from services.common.config import ConfigError, config_from_dict
from services.common.servers import ServerPool
from services.common.types import Completion, GenerationResult, PromptRecord, SamplingParams, ScoreResult
from services.generation.backend import HFBackend
from services.generation.client import GenerationClient
from services.generation.server import serve as serve_generation
from services.rollout.metrics import WorkerMetrics
from services.rollout.sampling import ServerSampler
from services.rollout.worker import retry_policy
from services.training.partial import PartialRollouts
from services.training.sampling import Prompt, ReplySampler
from tests.grpc_helpers import on_free_ports
from tests.rollout.conftest import _cfg

GREEDY = SamplingParams(n=2, temperature=0, max_new_tokens=12)
# reversals of several lengths on the warm-started tiny model: responses that stop in the first
# chunk, after a few, and one cut at max_new_tokens
TEXTS = ["ab=", "abcdefgh=", "hgfedcbaabcdefghij=", "q="]


@pytest.fixture(scope="module")
def backend(tiny_model_dir):
    return HFBackend(tiny_model_dir, "cpu")


class _Scorer:
    def score(self, samples):
        return [ScoreResult(0.0) for _ in samples]


def assert_same_greedy(model, prompt: list[int], paused: Completion, whole: Completion) -> None:
    """`paused` decodes what `whole` does: the same tokens and finish reason, log-probs within
    1e-4. Where the tokens part (a prefill and an incremental step round differently), the two best
    logits there must be a tie within 1e-4 and the two tokens those two; what follows is not compared."""
    a, b = paused.token_ids, whole.token_ids
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if k is None:
        assert a == b and paused.finish_reason == whole.finish_reason
        assert torch.allclose(torch.tensor(paused.log_probs), torch.tensor(whole.log_probs), atol=1e-4)
        return
    with torch.no_grad():
        logits = model(torch.tensor([prompt + a[:k]])).logits[0, -1].float()
    top = logits.topk(2)
    assert set(top.indices.tolist()) == {a[k], b[k]}, f"token {k}: {a[k]} vs {b[k]}, not the two best"
    assert (top.values[0] - top.values[1]).item() < 1e-4, f"token {k}: {a[k]} vs {b[k]} is no tie"


# ------------------------------------------------------------------------------------------------ the rounds
def test_rounds_resume_paused_samples_as_one_call_each():
    """A scripted backend: round 0 decodes every prompt's n samples; each later round sends only
    the paused ones, n=1, prompt + tokens so far, their first prompt's length, the next seed, at
    most min(partial_tokens, tokens left); the parts are joined, the oldest version the result's."""
    calls = []
    script = [  # per round: (version, completions)
        (3, [[Completion([5, 6], [-0.1, -0.2], "length"), Completion([7], [-0.3], "stop")]]),
        (4, [[Completion([8, 9], [-0.4, -0.5], "length", None, [4, 5])]]),
        (5, [[Completion([2], [-0.6], "length")]]),
    ]

    def call(prompts, params, first, part):
        calls.append((prompts, params, first, part))
        version, completions = script[part]
        return GenerationResult(completions, version, 0, 0.0)

    partial = PartialRollouts(call, 2)
    out = partial.generate([[1, 2, 3]], SamplingParams(n=2, max_new_tokens=5, seed=10))
    assert [(p, c.n, c.max_new_tokens, c.seed, f, r) for p, c, f, r in calls] == [
        ([[1, 2, 3]], 2, 2, 10, None, 0),
        ([[1, 2, 3, 5, 6]], 1, 2, 11, [3], 1),
        ([[1, 2, 3, 5, 6, 8, 9]], 1, 1, 12, [3], 2),  # one token left of 5
    ]
    long, short = out.completions[0]
    assert long.token_ids == [5, 6, 8, 9, 2] and long.log_probs == [-0.1, -0.2, -0.4, -0.5, -0.6]
    assert long.finish_reason == "length" and long.token_versions == [3, 3, 4, 5, 5]
    assert short.token_ids == [7] and short.token_versions is None  # every token the result's version
    assert out.policy_version == 3 and out.tokens == 6
    assert partial.metrics == {"rollout/partial_resumed": 2, "rollout/partial_rounds": 3}


def test_a_round_that_gives_nothing_back_is_an_error():
    def call(prompts, params, first, part):
        tokens = [4, 4] if part == 0 else []
        return GenerationResult([[Completion(tokens, [0.0] * len(tokens), "length")]], 0, 0, 0.0)

    with pytest.raises(RuntimeError, match="round 1 resumed a response and got no token back"):
        PartialRollouts(call, 2).generate([[1]], SamplingParams(max_new_tokens=6))


# ------------------------------------------------------------------------------------------------ greedy
def test_paused_every_3_tokens_equals_unpaused_under_greedy(backend):
    prompts = [backend.tokenizer(t)["input_ids"] for t in TEXTS]
    whole = backend.generate(prompts, GREEDY)
    partial = PartialRollouts(PartialRollouts.part_of(backend), 3)
    paused = partial.generate(prompts, GREEDY)
    finishes = [c.finish_reason for cs in whole.completions for c in cs]
    assert "stop" in finishes and "length" in finishes  # both ways of ending are covered
    assert max(len(c.token_ids) for cs in whole.completions for c in cs) > 6  # paused more than once
    for p, ps, ws in zip(prompts, paused.completions, whole.completions):
        assert len(ps) == len(ws) == GREEDY.n
        for a, b in zip(ps, ws):
            assert_same_greedy(backend.model, p, a, b)
            assert a.token_versions is None  # one version throughout
    assert paused.policy_version == whole.policy_version
    assert partial.metrics["rollout/partial_rounds"] == 4 and partial.metrics["rollout/partial_resumed"] > 0


class _PushedAfterEachCall:
    """`backend` whose weights move to the next version (a little noise added) after each call."""

    def __init__(self, backend: HFBackend):
        self.backend = backend

    def generate(self, prompts, params):
        out = self.backend.generate(prompts, params)
        torch.manual_seed(self.backend.policy_version)
        noisy = {k: v + 1e-3 * torch.randn_like(v) for k, v in self.backend.model.state_dict().items()}
        self.backend.update_weights(noisy, self.backend.policy_version + 1)
        return out


def test_each_part_keeps_the_version_that_sampled_it(tiny_model_dir):
    pushed = _PushedAfterEachCall(HFBackend(tiny_model_dir, "cpu"))
    prompts = [pushed.backend.tokenizer(t)["input_ids"] for t in TEXTS]
    out = PartialRollouts(PartialRollouts.part_of(pushed), 3).generate(prompts, GREEDY)
    assert out.policy_version == 0 and pushed.backend.policy_version >= 3
    for c in (c for cs in out.completions for c in cs):
        expected = [i // 3 for i in range(len(c.token_ids))]  # round r decoded tokens 3r..3r+2 on version r
        assert c.versions(out.policy_version) == expected
        assert (c.token_versions is None) == (len(c.token_ids) <= 3)


# ------------------------------------------------------------------------------------------------ the samplers
class _Calls:
    """A backend's `generate`, each call's prompts and params recorded."""

    def __init__(self, backend):
        self.backend, self.calls = backend, []
        self.tokenizer = backend.tokenizer

    def generate(self, prompts, params):
        self.calls.append((prompts, params))
        return self.backend.generate(prompts, params)


@pytest.mark.parametrize("partial_tokens", [0, 3])
def test_backend_sampler_in_parts_only_when_asked(tiny_model_dir, backend, partial_tokens):
    cfg = config_from_dict(
        {
            "model": {"path": tiny_model_dir, "device": "cpu"},
            "response_length": 12,
            "num_return_sequences_in_group": 2,
            "generation": {"temperature": 1e-6},  # greedy
            "rollout": {"partial_tokens": partial_tokens},
        }
    )
    spy = _Calls(backend)
    prompts = [Prompt(PromptRecord(str(i), t), f"0:{i}") for i, t in enumerate(TEXTS)]
    params = SamplingParams.for_training(cfg)
    reply = ReplySampler(spy, _Scorer(), backend.tokenizer, params, partial_tokens=cfg.rollout.partial_tokens)
    sampled = reply.sample(prompts)
    if partial_tokens == 0:  # not wrapped: the one call as ever
        assert [p.max_new_tokens for _, p in spy.calls] == [12]
        assert not any(k.startswith("rollout/partial") for k in sampled.metrics)
        return
    assert [p.max_new_tokens for _, p in spy.calls] == [3, 3, 3, 3]
    assert sampled.metrics["rollout/partial_rounds"] == 4 and sampled.metrics["rollout/partial_resumed"] > 0
    whole = backend.generate(spy.calls[0][0], SamplingParams.for_training(cfg))
    for g, ws in zip(sampled.groups, whole.completions):
        for a, b in zip(g.completions, ws):
            assert_same_greedy(backend.model, g.prompt_ids, a, b)


class _KeyedCalls:
    """A generation client's `generate`, each call's prompt lengths, key and first_prompt_tokens
    (absent: the caller did not pass it) recorded."""

    def __init__(self, client: GenerationClient):
        self.client, self.calls = client, []

    def generate(self, prompts, params, timeout=None, key=None, **kw):
        self.calls.append(([len(p) for p in prompts], key, kw.get("first_prompt_tokens", "absent")))
        return self.client.generate(prompts, params, timeout=timeout, key=key, **kw)


def _server_sampler(cfg, tokenizer, client) -> ServerSampler:
    pool = ServerPool.fixed("the-server", lambda _address: client)
    return ServerSampler(cfg, tokenizer, pool, retry_policy(cfg), _Scorer(), None, threading.Event(), WorkerMetrics())


def test_a_worker_resumes_on_a_generation_server_past_prompt_length(model_dir):
    """Through gRPC: each round's continuations one Generate with a key of its own and the first
    prompt's length, accepted though prompt + tokens are longer than prompt_length; greedy, the
    groups are those sampled without a pause (where the untrained model's responses are long)."""
    over = {"response_length": 10, "generation": {"temperature": 1e-6}}
    cfg = _cfg(model_dir, None, "unused", rollout={"partial_tokens": 3}, **over)
    records = [PromptRecord("long", "abcdefghabcd="), PromptRecord("short", "abc=")]
    with serve_generation(on_free_ports(cfg, "generation")) as svc:
        client = GenerationClient(f"127.0.0.1:{svc.server.port}", cfg.rpc)
        try:
            paused, whole = _KeyedCalls(client), _KeyedCalls(client)
            tok = svc.servicer.tok
            prompts = [Prompt(r, f"0:{r.id}") for r in records]
            got = _server_sampler(cfg, tok, paused).sample(prompts)
            unpaused_cfg = _cfg(model_dir, None, "unused", **over)
            want = _server_sampler(unpaused_cfg, tok, whole).sample(prompts)
        finally:
            client.close()
        model = svc.servicer.backend.model
    assert len(whole.calls) == 1 and whole.calls[0][2] == "absent"  # off: the one call as ever
    firsts = [len(tok(r.prompt)["input_ids"]) for r in records]
    key = paused.calls[0][1]
    assert paused.calls[0] == (firsts, key, "absent")
    assert len(paused.calls) > 1 and got.metrics["rollout/partial_rounds"] == len(paused.calls)
    for r, (lengths, k, first) in enumerate(paused.calls[1:], start=1):
        assert k == f"{key}/{r}" and all(f in firsts for f in first)
        assert all(n == f + 3 * r for n, f in zip(lengths, first))
    assert max(n for lengths, _, _ in paused.calls for n in lengths) > cfg.prompt_length
    for g, w in zip(got.groups, want.groups):
        assert g.policy_version == w.policy_version == 0
        for a, b in zip(g.completions, w.completions):
            assert_same_greedy(model, g.prompt_ids, a, b)


# ------------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("kind,ref", [("agent", "agent.py:run"), ("agent_url", "http://127.0.0.1:9/agent")])
def test_partial_rollouts_with_sessions_are_refused(kind, ref):
    with pytest.raises(ConfigError, match=f"partial_tokens=4 with {kind}: .*Set rollout.partial_tokens: 0"):
        config_from_dict({"rollout": {"partial_tokens": 4, kind: ref}})
    assert config_from_dict({"rollout": {"partial_tokens": 0, kind: ref}}).rollout.partial_tokens == 0
