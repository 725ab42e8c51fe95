"""The `hf` backend's decoding loop (services/generation/decode.py): each prompt prefilled once
for its group, the KV cache copied to its samples, finished rows dropped from the batch, and the
sampled tokens' log-probs kept step by step. Checked against transformers' `generate` (greedy) and
against a full forward of every sampled sequence without any cache (sampling)."""

import pytest
import torch

from services.common.padding import pad_left
from services.common.types import SamplingParams
from services.generation.backend import HFBackend
from services.generation.decode import decode, sampling_logits

TEXTS = ["abc=", "hgfed=", "ab=", "dcbahgfe="]


def _prompts(b):
    return [b.tokenizer(t)["input_ids"] for t in TEXTS]


def test_greedy_matches_generate_on_the_expanded_batch(tiny_model_dir):
    """The same tokens as `generate` on the prompts repeated n times (its expanded prefill), and
    the same log-probs: compared up to the first step where generate's top two logits are within
    1e-3 (a near-tie that float rounding of another batch shape may flip)."""
    b = HFBackend(tiny_model_dir, "cpu")
    prompts, n, T = _prompts(b), 3, 12
    out = decode(
        b.model, prompts, SamplingParams(n=n, temperature=0, max_new_tokens=T), b.pad_token_id, [b.eos_token_id]
    )
    ids, attn = pad_left([p for p in prompts for _ in range(n)], b.pad_token_id)
    with torch.no_grad():
        ref = b.model.generate(
            input_ids=ids,
            attention_mask=attn,
            do_sample=False,
            max_new_tokens=T,
            eos_token_id=b.eos_token_id,
            pad_token_id=b.pad_token_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
    scores = torch.stack(ref.scores, 1).float()  # (N, steps, V)
    seqs = ref.sequences[:, ids.shape[1] :]
    compared = 0
    for i in range(len(prompts) * n):
        for j, tok in enumerate(out.tokens[i]):
            top2 = scores[i, j].topk(2).values
            if top2[0] - top2[1] < 1e-3:
                break
            assert tok == seqs[i, j].item(), (i, j)
            want = torch.log_softmax(scores[i, j], -1)[tok].item()
            assert abs(out.logps[i][j] - want) < 1e-4, (i, j)
            compared += 1
        else:
            # a sample that ended before the limit ended on EOS, as generate's did
            if len(out.tokens[i]) < T:
                assert out.finish[i] == "stop" and seqs[i, len(out.tokens[i]) - 1] == b.eos_token_id
    assert compared >= len(prompts) * n * 2  # most of the tokens, not a vacuous check


def test_sampled_log_probs_match_a_forward_without_cache(tiny_model_dir):
    """Every sampled token's recorded log-prob equals the sampling distribution's log-prob from a
    plain forward of prompt + response (no cache, no shared prefill): the copied cache, the
    positions under left padding and the dropping of finished rows are all right. A frequent stop
    token makes rows finish at different steps, so rows are dropped mid-batch."""
    b = HFBackend(tiny_model_dir, "cpu")
    prompts = _prompts(b)
    params = SamplingParams(n=4, temperature=0.8, top_k=20, top_p=0.95, max_new_tokens=10)
    torch.manual_seed(3)
    first = decode(
        b.model, prompts, SamplingParams(n=16, temperature=1.0, max_new_tokens=1), b.pad_token_id, [b.eos_token_id]
    )
    common = max(set(t[0] for t in first.tokens), key=[t[0] for t in first.tokens].count)
    torch.manual_seed(4)
    out = decode(b.model, prompts, params, b.pad_token_id, [b.eos_token_id, common])
    lengths = [len(t) for t in out.tokens]
    assert min(lengths) < max(lengths)  # rows finished at different steps
    for i, (toks, lps) in enumerate(zip(out.tokens, out.logps)):
        prompt = prompts[i // params.n]
        with torch.no_grad():
            logits = b.model(torch.tensor([prompt + toks])).logits[0, len(prompt) - 1 : -1]
        want = torch.log_softmax(sampling_logits(logits, params), -1).gather(-1, torch.tensor(toks)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(lps), want, atol=1e-4), i
        assert all(t not in (b.eos_token_id, common) for t in toks[:-1])
        assert out.finish[i] == ("stop" if toks[-1] in (b.eos_token_id, common) else "length")


def test_sampling_draws_from_the_model_distribution(tiny_model_dir):
    """The first and the second sampled tokens follow the model's own probabilities (the second
    through the copied cache): total variation distance between 4,000 draws and the exact
    distribution below 0.1 (its expected value here is about 0.03; fixed seed)."""
    b = HFBackend(tiny_model_dir, "cpu")
    prompt = b.tokenizer("hgfed=")["input_ids"]
    torch.manual_seed(0)
    out = decode(b.model, [prompt], SamplingParams(n=4000, temperature=1.0, max_new_tokens=2), b.pad_token_id, [])
    V = b.vocab_size
    with torch.no_grad():
        p1 = torch.softmax(b.model(torch.tensor([prompt])).logits[0, -1].float(), -1)
    firsts = torch.tensor([t[0] for t in out.tokens])
    emp1 = torch.bincount(firsts, minlength=V).float() / len(firsts)
    assert 0.5 * (emp1 - p1).abs().sum() < 0.1
    t1 = torch.bincount(firsts, minlength=V).argmax().item()
    seconds = torch.tensor([t[1] for t in out.tokens if t[0] == t1])
    assert len(seconds) > 500
    with torch.no_grad():
        p2 = torch.softmax(b.model(torch.tensor([prompt + [t1]])).logits[0, -1].float(), -1)
    emp2 = torch.bincount(seconds, minlength=V).float() / len(seconds)
    assert 0.5 * (emp2 - p2).abs().sum() < 0.15


def test_bf16_engine_takes_float32_pushes(tiny_model_dir):
    """With model.bf16 the engine runs in bfloat16 but says it takes float32 tensors (what the
    learner pushes) and casts them as they load; its greedy samples are the float32 engine's for
    most tokens."""
    b32 = HFBackend(tiny_model_dir, "cpu")
    b16 = HFBackend(tiny_model_dir, "cpu", torch.bfloat16)
    assert b16.info()["dtype"] == "bfloat16"
    assert b16.parameter_specs() == b32.parameter_specs()
    assert {d for _, d in b16.parameter_specs().values()} == {torch.float32}
    state = {k: v.clone() for k, v in b32.model.state_dict().items()}
    b16.update_weights(state, 1)
    assert b16.policy_version == 1 and next(b16.model.parameters()).dtype == torch.bfloat16
    params = SamplingParams(n=1, temperature=0, max_new_tokens=8)
    prompts = _prompts(b32)
    a = [c[0].token_ids for c in b32.generate(prompts, params).completions]
    c = [c[0].token_ids for c in b16.generate(prompts, params).completions]
    same = sum(x == y for r, s in zip(a, c) for x, y in zip(r, s))
    assert same >= 0.5 * sum(len(r) for r in a)


@pytest.mark.parametrize("dtype,expect", [("auto", "bfloat16"), ("float32", "float32"), ("bfloat16", "bfloat16")])
def test_sampler_dtype_apart_from_the_learners(tiny_model_dir, dtype, expect):
    """generation.dtype sets the sampler's dtype; auto follows model.bf16. Under model.bf16 a
    float32 sampler is what follows the policy's small steps (docs/speed.md)."""
    from services.common.config import config_from_dict
    from services.generation.policy import make_backend

    cfg = config_from_dict(
        {"model": {"path": tiny_model_dir, "device": "cpu", "bf16": True}, "generation": {"dtype": dtype}}
    )
    backend = make_backend(cfg)
    assert backend.info()["dtype"] == expect
    assert next(backend.model.parameters()).dtype == getattr(torch, expect)


def test_the_old_vllm_dtype_key_says_where_it_went():
    from services.common.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match="generation.vllm.dtype is now generation.dtype"):
        config_from_dict({"generation": {"vllm": {"dtype": "float32"}}})
