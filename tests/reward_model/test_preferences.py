"""Preference rows in each format people have parse to the prompt the policy sees (chat messages
rendered through the chat template once) and the two response texts; the pairwise loss and its
gradient on hand-made scores."""

import json
import math

import pytest
import torch

from services.common.model_files import load_tokenizer
from services.reward_model.preferences import PreferenceKeys, load_preferences, preference_from_row, split_held_out
from services.reward_model.train import pairwise_loss


@pytest.fixture(scope="module")
def tok(untrained_model_dir):
    return load_tokenizer(untrained_model_dir)  # a real tokenizer with a chat template ("user: ...\nassistant: ")


KEYS = PreferenceKeys()


def test_the_pairwise_loss_and_its_gradient_on_hand_made_scores():
    c = torch.tensor([2.0, 0.0], requires_grad=True)
    r = torch.tensor([0.0, 1.0], requires_grad=True)
    loss = pairwise_loss(c, r)
    want = (math.log1p(math.exp(-2.0)) + math.log1p(math.exp(1.0))) / 2  # -log sigmoid(d) = log(1 + e^-d)
    assert loss.item() == pytest.approx(want, rel=1e-6)
    loss.backward()
    sig = lambda d: 1 / (1 + math.exp(-d))  # noqa: E731
    # d/dc of -log sigmoid(c - r) / n = -(1 - sigmoid(c - r)) / n; r gets the opposite
    assert c.grad.tolist() == pytest.approx([-(1 - sig(2.0)) / 2, -(1 - sig(-1.0)) / 2], rel=1e-6)
    assert r.grad.tolist() == pytest.approx([(1 - sig(2.0)) / 2, (1 - sig(-1.0)) / 2], rel=1e-6)
    # a margin asks for a larger gap: the same scores cost more
    assert pairwise_loss(c, r, torch.tensor([1.0, 1.0])).item() > loss.item()
    assert pairwise_loss(torch.tensor([3.0]), torch.tensor([0.0]), 1.0).item() == pytest.approx(
        math.log1p(math.exp(-2.0)), rel=1e-6
    )


def test_trl_explicit_prompt_strings(tok):
    p = preference_from_row({"prompt": "abc=", "chosen": "cba", "rejected": "abc"}, "x:1", KEYS, tok)
    assert (p.prompt, p.chosen, p.rejected) == ("abc=", "cba", "abc") and p.texts == ("abc=cba", "abc=abc")
    # a string prompt as one user message, when asked
    p = preference_from_row(
        {"prompt": "abc=", "chosen": "cba", "rejected": "abc"}, "x:1", KEYS, tok, chat_template=True
    )
    assert p.prompt == "user: abc=\nassistant: " and p.texts[0] == "user: abc=\nassistant: cba"


def test_trl_conversational_rendered_through_the_template_once(tok):
    row = {
        "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "abc="}],
        "chosen": [{"role": "assistant", "content": "cba"}],
        "rejected": [{"role": "assistant", "content": "no idea"}],
    }
    p = preference_from_row(row, "x:1", KEYS, tok)
    assert p.prompt == "system: be brief\nuser: abc=\nassistant: "
    assert p.texts == (
        "system: be brief\nuser: abc=\nassistant: cba",
        "system: be brief\nuser: abc=\nassistant: no idea",
    )


def test_trl_implicit_prompt_the_shared_messages(tok):
    user = {"role": "user", "content": "abc="}
    row = {
        "chosen": [user, {"role": "assistant", "content": "cba"}],
        "rejected": [user, {"role": "assistant", "content": "bca"}],
    }
    p = preference_from_row(row, "x:1", KEYS, tok)
    assert (p.prompt, p.chosen, p.rejected) == ("user: abc=\nassistant: ", "cba", "bca")
    whole = preference_from_row({"chosen": "abc=cba", "rejected": "abc=bca"}, "x:2", KEYS, tok)
    assert whole.texts == ("abc=cba", "abc=bca") and whole.prompt == ""


def test_openrlhf_keys_and_margin(tok):
    keys = PreferenceKeys(prompt="context_messages", chosen="winner", rejected="loser", margin="margin")
    row = {"context_messages": [{"role": "user", "content": "ab="}], "winner": "ba", "loser": "ab", "margin": 0.5}
    p = preference_from_row(row, "x:1", keys, tok)
    assert (p.prompt, p.chosen, p.rejected, p.margin) == ("user: ab=\nassistant: ", "ba", "ab", 0.5)


def test_rows_that_cannot_be_a_pair_say_why(tok):
    with pytest.raises(ValueError, match="x:1: no 'rejected' field .*reward_model.chosen_key"):
        preference_from_row({"prompt": "a", "chosen": "b"}, "x:1", KEYS, tok)
    with pytest.raises(ValueError, match="chosen must be the assistant's answer"):
        preference_from_row(
            {"prompt": "a", "chosen": [{"role": "user", "content": "b"}], "rejected": "c"}, "x:1", KEYS, tok
        )
    with pytest.raises(ValueError, match="share no leading message"):
        preference_from_row(
            {"chosen": [{"role": "user", "content": "a"}], "rejected": [{"role": "user", "content": "b"}]},
            "x:1",
            KEYS,
            tok,
        )


def test_a_jsonl_file_and_a_parquet_file_read_the_same(tok, tmp_path):
    rows = [{"prompt": f"{s}=", "chosen": s[::-1], "rejected": s} for s in ("abc", "bcd", "cde", "def")]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "p.parquet"))
    a = load_preferences(str(tmp_path / "p.jsonl"), "train", KEYS, tok)
    b = load_preferences(str(tmp_path / "p.parquet"), "train", KEYS, tok)
    assert (
        [x.texts for x in a]
        == [x.texts for x in b]
        == [(f"{s}={s[::-1]}", f"{s}={s}") for s in ("abc", "bcd", "cde", "def")]
    )


def test_the_held_out_split_keeps_a_prompt_on_one_side(tok):
    rows = [{"prompt": f"p{i % 10}", "chosen": "a", "rejected": f"b{i}"} for i in range(40)]
    pairs = [preference_from_row(r, f"x:{i}", KEYS, tok) for i, r in enumerate(rows)]
    train, held = split_held_out(pairs, 0.2, seed=0)
    assert len({p.prompt for p in held}) == 2 and len(train) + len(held) == 40
    assert not {p.prompt for p in held} & {p.prompt for p in train}
