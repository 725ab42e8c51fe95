import torch

from services.common.types import SamplingParams
from services.generation.backend import HFBackend


def test_n_samples_logprobs_finish_reasons_and_seed(tiny_model_dir):
    b = HFBackend(tiny_model_dir, "cpu")
    prompts = [b.tokenizer("abc=")["input_ids"], b.tokenizer("hgfed=")["input_ids"]]
    res = b.generate(prompts, SamplingParams(n=3, max_new_tokens=6, seed=11))
    assert len(res.completions) == 2 and all(len(c) == 3 for c in res.completions)
    for comps in res.completions:
        for c in comps:
            assert len(c.token_ids) == len(c.log_probs) <= 6
            assert all(lp <= 0 for lp in c.log_probs)
            if c.finish_reason == "stop":
                assert c.token_ids[-1] == b.eos_token_id and b.eos_token_id not in c.token_ids[:-1]
            else:
                assert c.finish_reason == "length" and len(c.token_ids) == 6
    again = b.generate(prompts, SamplingParams(n=3, max_new_tokens=6, seed=11))
    assert [[c.token_ids for c in p] for p in res.completions] == [[c.token_ids for c in p] for p in again.completions]
    assert res.tokens == sum(len(c.token_ids) for p in res.completions for c in p)


def test_stop_tokens_and_greedy(tiny_model_dir):
    b = HFBackend(tiny_model_dir, "cpu")
    p = [b.tokenizer("abcd=")["input_ids"]]
    greedy = b.generate(p, SamplingParams(temperature=0, max_new_tokens=8)).completions[0][0]
    first = greedy.token_ids[0]
    stopped = b.generate(p, SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=[first])).completions[0][0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"


def test_logprobs_are_of_the_temperature_scaled_distribution(tiny_model_dir):
    b = HFBackend(tiny_model_dir, "cpu")
    ids = b.tokenizer("abc=")["input_ids"]
    c = b.generate([ids], SamplingParams(temperature=0.5, max_new_tokens=1, seed=0)).completions[0][0]
    with torch.no_grad():
        logits = b.model(torch.tensor([ids])).logits[0, -1] / 0.5
    assert abs(torch.log_softmax(logits, -1)[c.token_ids[0]].item() - c.log_probs[0]) < 1e-4
