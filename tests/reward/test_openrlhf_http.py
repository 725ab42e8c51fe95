"""The reward server's HTTP endpoint as OpenRLHF calls it: the query is the prompt and response
token ids decoded with their special tokens kept, so it ends with EOS (and, from a padded batch,
pad tokens) and may start with pads and BOS. The rewards must be those of the bare response."""

import time
from pathlib import Path

import httpx
import pytest

from services.common.config import load_config
from services.common.lifecycle import HTTPServerThread
from services.common.model_files import load_tokenizer
from services.reward.scorer import build_scorer
from services.reward.server import build_http_app, special_token_strings

TINY_CPU = Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.yaml"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def reward_url(tiny_model_dir):
    scorer = build_scorer(load_config(TINY_CPU).reward)  # exact_match + edit_distance: 2.0 at best
    http = HTTPServerThread(build_http_app(scorer, strip_tokens=special_token_strings(tiny_model_dir)), "127.0.0.1", 0)
    port = http.start()
    yield f"http://127.0.0.1:{port}"
    http.stop()


def openrlhf_query(tokenizer, prompt: str, response: str) -> str:
    """What OpenRLHF's single-turn executor sends as `query`: the prompt's ids (tokenized without
    special tokens) and the generated ids (ending with EOS), decoded with special tokens kept."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    action_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return tokenizer.decode(prompt_ids + action_ids, skip_special_tokens=False)


def padded_query(tokenizer, prompt: str, response: str, pad: int) -> str:
    """A row of a left/right-padded batch (BOS-prefixed prompt) decoded with special tokens kept."""
    ids = (
        [tokenizer.pad_token_id] * pad
        + tokenizer(prompt)["input_ids"]
        + tokenizer(response, add_special_tokens=False)["input_ids"]
        + [tokenizer.eos_token_id]
        + [tokenizer.pad_token_id] * pad
    )
    return tokenizer.decode(ids, skip_special_tokens=False)


def post(url: str, queries, prompts, labels) -> dict:
    """OpenRLHF's request: a JSON body {"query", "prompts", "labels"}, one entry per sample."""
    r = httpx.post(url, json={"query": queries, "prompts": prompts, "labels": labels}, timeout=30)
    r.raise_for_status()
    return r.json()


def test_special_token_strings_are_the_tokenizers(tiny_model_dir):
    assert sorted(special_token_strings(tiny_model_dir)) == ["</s>", "<pad>", "<s>"]


@pytest.mark.parametrize("endpoint", ["/get_reward", "/score"])
def test_eos_suffixed_query_of_a_correct_reversal_scores_two(reward_url, tokenizer, endpoint):
    query = openrlhf_query(tokenizer, "abcd=", "dcba")
    assert query == "abcd=dcba" + tokenizer.eos_token
    body = post(reward_url + endpoint, [query], ["abcd="], ["dcba"])
    # OpenRLHF reads "rewards", "scores" (for dynamic filtering; "rewards" when absent) and "extra_logs"
    assert body["rewards"] == [2.0]
    assert body["scores"] == [2.0]
    assert body["extra_logs"] == {"exact_match": [1.0], "edit_distance": [1.0]}


def test_padded_and_bos_prefixed_queries_score_their_bare_response(reward_url, tokenizer):
    bos = tokenizer.bos_token
    queries = [
        padded_query(tokenizer, "abcd=", "dcba", pad=2),
        openrlhf_query(tokenizer, bos + "xyz=", "zyx"),
        openrlhf_query(tokenizer, "abcd=", "dcbx"),
    ]
    assert queries[0].startswith(tokenizer.pad_token + tokenizer.pad_token + bos)
    body = post(reward_url + "/get_reward", queries, ["abcd=", bos + "xyz=", "abcd="], ["dcba", "zyx", "dcba"])
    assert body["rewards"] == [2.0, 2.0, 0.75]  # the wrong one: no exact match, 3 of 4 characters


def test_long_runs_of_special_tokens_are_stripped_in_linear_time(reward_url, tokenizer):
    pads = tokenizer.pad_token * 19_000  # 95k characters in the middle of the query
    t0 = time.monotonic()
    body = post(reward_url + "/get_reward", ["abcd=" + pads + "dcba" + tokenizer.eos_token], ["abcd="], ["dcba"])
    assert time.monotonic() - t0 < 60  # a backtracking regex took minutes (idle: milliseconds)
    assert body["rewards"] == [1 - len(pads) / (len(pads) + 4)]  # no exact match; the edit similarity
