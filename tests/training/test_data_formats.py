"""Peers' data formats (verl's parquet, OpenRLHF's jsonl, GSM8K's rows), the chat-template
options and the synthetic arithmetic task: records in, prompt text and label out."""

import json
import re
from pathlib import Path

import pytest

from services.cli.tiny import build_tokenizer
from services.common.config import config_from_dict
from services.training.data import load_prompts, source_problem
from services.training.sources.records import gsm8k_label, render_prompt
from services.training.sources.synthetic import arithmetic_task

ROOT = Path(__file__).resolve().parents[2]

QUESTION = "Natalia sold 48 clips in April and half as many in May. How many in all?"


@pytest.fixture(scope="module")
def tok():
    """The tiny character tokenizer; its chat template renders `role: content` lines."""
    return build_tokenizer()


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _not_a_list_repr(text):
    assert "[{" not in text and "{'role'" not in text and '{"role"' not in text


def test_verl_parquet_prompt_messages_ground_truth_and_data_source(tok, tmp_path):
    import datasets

    rows = [
        {
            "data_source": "openai/gsm8k",
            "ability": "math",
            "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": QUESTION}],
            "reward_model": {"style": "rule", "ground_truth": "72"},
            "extra_info": {"split": "train", "index": 0},
        },
        {
            "data_source": "openai/gsm8k",
            "ability": "math",
            "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1 + 1?"}],
            "reward_model": {"style": "rule", "ground_truth": "2"},
            "extra_info": {"split": "train", "index": 1},
        },
    ]
    path = str(tmp_path / "train.parquet")
    datasets.Dataset.from_list(rows).to_parquet(path)
    recs = load_prompts(path, "train", tok)
    assert [r.prompt for r in recs] == [
        f"system: be brief\nuser: {QUESTION}\nassistant: ",
        "system: be brief\nuser: 1 + 1?\nassistant: ",
    ]
    assert [r.label for r in recs] == ["72", "2"] and [r.id for r in recs] == ["train.parquet:0", "train.parquet:1"]
    assert recs[0].metadata == {
        "data_source": "openai/gsm8k",
        "ability": "math",
        "extra_info": {"split": "train", "index": 0},
    }
    for r in recs:
        _not_a_list_repr(r.prompt)
    # chat_template only adds to string prompts: list prompts render the same with it on
    assert load_prompts(path, "train", tok, chat_template=True, system_prompt="other")[0].prompt == recs[0].prompt


def test_a_list_prompt_without_a_chat_template_is_a_clear_error(tok, tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": [{"role": "user", "content": "hi"}], "label": "x"}])
    with pytest.raises(ValueError, match="need a tokenizer with a chat template.*none was given"):
        load_prompts(path, "train")
    bare = build_tokenizer()
    bare.chat_template = None
    with pytest.raises(ValueError, match="need a tokenizer with a chat template.*this tokenizer has none"):
        load_prompts(path, "train", bare)
    with pytest.raises(ValueError, match="chat template"):
        load_prompts(_jsonl(tmp_path / "s.jsonl", [{"prompt": "hi"}]), "train", bare, chat_template=True)
    with pytest.raises(ValueError, match="a list prompt must be chat messages"):
        load_prompts(_jsonl(tmp_path / "l.jsonl", [{"prompt": ["a", "b"]}]), "train", tok)


def test_openrlhf_jsonl_with_custom_input_and_label_keys(tok, tmp_path):
    rows = [
        {"input": "2 + 3 =", "target": 5, "source": "toy"},
        {"input": [{"role": "user", "content": "4 + 4 ="}], "target": "8", "source": "toy"},
    ]
    path = _jsonl(tmp_path / "o.jsonl", rows)
    recs = load_prompts(path, "train", tok, prompt_key="input", label_key="target")
    assert [r.prompt for r in recs] == ["2 + 3 =", "user: 4 + 4 =\nassistant: "]
    assert [r.label for r in recs] == ["5", "8"] and recs[0].metadata == {"source": "toy"}
    recs = load_prompts(path, "train", tok, prompt_key="input", label_key="target", chat_template=True)
    assert [r.prompt for r in recs] == ["user: 2 + 3 =\nassistant: ", "user: 4 + 4 =\nassistant: "]


def test_gsm8k_rows_question_and_the_number_after_the_marks(tok, tmp_path):
    import datasets

    rows = [
        {"question": QUESTION, "answer": "48 / 2 = <<48/2=24>>24\n48 + 24 = <<48+24=72>>72\n#### 72"},
        {"question": "How many cents?", "answer": "It is 1,234 cents.\n#### 1,234"},
    ]
    path = _jsonl(tmp_path / "gsm8k.jsonl", rows)
    recs = load_prompts(path, "train", tok)
    assert [(r.prompt, r.label, r.metadata) for r in recs] == [(QUESTION, "72", {}), ("How many cents?", "1234", {})]
    recs = load_prompts(path, "train", tok, chat_template=True, system_prompt="Think step by step.")
    assert recs[1].prompt == "system: Think step by step.\nuser: How many cents?\nassistant: "
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "gsm8k.parquet"))
    assert [r.label for r in load_prompts(str(tmp_path / "gsm8k.parquet"), "eval", tok)] == ["72", "1234"]
    # a `question` field that is the configured prompt_key is read as such, its `answer` as the label key says
    recs = load_prompts(path, "train", tok, prompt_key="question", label_key="answer")
    assert recs[0].prompt == QUESTION and recs[0].label.endswith("#### 72")


def test_gsm8k_label_and_the_hub_source_string():
    assert gsm8k_label("so 5 + 5 = 10\n#### -1,000") == "-1000"
    assert gsm8k_label("  42 ") == "42"
    assert source_problem("hf:openai/gsm8k:main") is None
    assert source_problem("hf:openai/gsm8k:main@test") is None


def test_plain_string_prompts_with_and_without_the_chat_template(tok, tmp_path):
    path = _jsonl(
        tmp_path / "p.jsonl",
        [{"prompt": "abc=", "label": "cba"}, {"messages": [{"role": "user", "content": "x"}], "solution": 4}],
    )
    assert [r.prompt for r in load_prompts(path, "train", tok)] == ["abc=", "user: x\nassistant: "]
    assert [r.prompt for r in load_prompts(path, "train", tok, chat_template=True)] == [
        "user: abc=\nassistant: ",
        "user: x\nassistant: ",
    ]
    assert load_prompts(path, "train", tok, chat_template=True, system_prompt="S")[0].prompt == (
        "system: S\nuser: abc=\nassistant: "
    )
    assert render_prompt("abc=", None) == "abc="
    with pytest.raises(ValueError, match="prompt is null"):
        load_prompts(_jsonl(tmp_path / "n.jsonl", [{"prompt": None}]), "train", tok)


def test_chat_template_config_keys():
    d = config_from_dict({"data": {"chat_template": True, "system_prompt": "S"}}).data
    assert d.chat_template is True and d.system_prompt == "S"
    default = config_from_dict({}).data
    assert default.chat_template is False and default.system_prompt is None
    with pytest.raises(Exception, match="system_prompt is only used with data.chat_template"):
        config_from_dict({"data": {"system_prompt": "S"}})


def _pair(prompt):
    a, b = map(int, re.fullmatch(r"What is (\d+) \+ (\d+)\? Answer with the number only\.", prompt).groups())
    return a, b


def test_arithmetic_task_splits_labels_and_a_fixed_eval():
    train, held = arithmetic_task("train"), arithmetic_task("eval")
    assert len(train) + len(held) == 90 * 90 and 0.1 < len(held) / 8100 < 0.3
    train_pairs = {frozenset(_pair(r.prompt)) for r in train}
    held_pairs = {frozenset(_pair(r.prompt)) for r in held}
    assert not train_pairs & held_pairs  # disjoint, and b + a never trains on a held-out a + b
    for r in train[:50] + held[:50]:
        a, b = _pair(r.prompt)
        assert 10 <= a <= 99 and 10 <= b <= 99 and r.label == str(a + b)
    assert [r.id for r in arithmetic_task("eval", 20, seed=0)] == [r.id for r in arithmetic_task("eval", 20, seed=7)]
    assert [r.id for r in arithmetic_task("eval", 20)] == [r.id for r in held[:20]]
    assert [r.id for r in arithmetic_task("train", 20, seed=0)] != [r.id for r in arithmetic_task("train", 20, seed=1)]
    assert len(arithmetic_task("train", 5)) == 5


def test_multiply_task_holds_out_the_same_pairs_with_products():
    from services.training.sources.synthetic import multiply_task

    train, held = multiply_task("train"), multiply_task("eval")
    pairs = {frozenset((r.metadata["a"], r.metadata["b"])) for r in held}
    assert pairs == {frozenset(_pair(r.prompt)) for r in arithmetic_task("eval")}  # the same split
    assert not pairs & {frozenset((r.metadata["a"], r.metadata["b"])) for r in train}
    for r in train[:50] + held[:50]:
        a, b = r.metadata["a"], r.metadata["b"]
        assert r.prompt == f"What is {a} times {b}? Answer with the number only." and r.label == str(a * b)
    assert source_problem("synthetic:multiply") is None


def test_the_calculator_example_answers_the_call_the_policy_wrote():
    """examples/calculator_env.py: a calculation is a call answered with its own result (a wrong
    number copied gives a wrong result); the next reply is the answer; a reply without a
    calculation is the answer at once."""
    from services.common.userfn import load_function
    from services.training.sources.synthetic import multiply_task

    Calculator = load_function(str(ROOT / "examples/calculator_env.py") + ":Calculator")
    sample = multiply_task("eval", 1)[0]
    a, b = sample.metadata["a"], sample.metadata["b"]
    env = Calculator()
    assert f"What is {a} times {b}?" in env.reset(sample)
    message, reward, done = env.step(f"{a} * {b} = 12")
    assert message.startswith(f"Calculator: {a} * {b} = {a * b}.") and (reward, done) == (0.0, False)
    assert env.step(f"The answer is {a * b:,}.") == (None, 1.0, True)
    env.reset(sample)
    assert "= 0." in env.step(f"{a} * 0")[0]  # the call it wrote, not the question's
    assert env.step("0") == (None, 0.0, True)
    env.reset(sample)
    assert env.step("I think it is 5") == (None, 0.0, True)


def test_arithmetic_through_load_prompts_and_the_chat_template(tok):
    assert source_problem("synthetic:arithmetic") is None
    recs = load_prompts("synthetic:arithmetic", "eval", limit=3)
    assert [r.prompt for r in recs] == [r.prompt for r in arithmetic_task("eval", 3)]
    wrapped = load_prompts("synthetic:arithmetic", "eval", tok, limit=3, chat_template=True)
    assert [r.prompt for r in wrapped] == [f"user: {r.prompt}\nassistant: " for r in recs]
    assert [r.label for r in wrapped] == [r.label for r in recs]
