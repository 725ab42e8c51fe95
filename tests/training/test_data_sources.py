import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.config import config_from_dict
from services.common.types import PromptRecord
from services.training.data import data_source_errors, drop_overlong, load_prompts

ROOT = Path(__file__).resolve().parents[2]


def _errors(data: dict) -> list[str]:
    return data_source_errors(config_from_dict({"data": data}))


def test_missing_data_sources_are_config_errors_naming_the_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    here = f"(relative paths are read from the current directory, {tmp_path})"  # not the config file's
    assert _errors({"train": "missing.jsonl", "eval": "hf:/no/such/dir"}) == [
        f"data.train: no such file missing.jsonl {here}",
        "data.eval: no such dataset directory /no/such/dir",
    ]
    assert _errors({"train": "p.parquet"}) == [f"data.train: no such file p.parquet {here}"]
    assert _errors({"eval": "hf:./dsdir@test"}) == [f"data.eval: no such dataset directory dsdir {here}"]
    assert _errors({"train": "synthetic:sort"}) == [
        "data.train: unknown synthetic task 'sort'; valid: reverse, arithmetic, multiply"
    ]


def test_existing_relative_sources_and_hub_names_validate(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text('{"prompt": "ab=", "label": "ba"}\n')
    (tmp_path / "dsdir").mkdir()
    assert _errors({"train": "p.jsonl", "eval": "hf:./dsdir@test"}) == []
    assert _errors({"train": "hf:dsdir", "eval": "hf:openai/gsm8k:main@test"}) == []
    assert _errors({"train": "synthetic:arithmetic", "eval": "hf:openai/gsm8k:main"}) == []


def test_cli_validate_rejects_a_missing_data_file():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "config",
            "validate",
            "configs/tiny-cpu.yaml",
            "--set",
            "data.train=missing.jsonl",
            "--set",
            "data.eval=hf:/no/such/dir",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 2
    assert "data.train: no such file missing.jsonl" in r.stderr and "data.eval: no such dataset directory" in r.stderr


def _save(path: Path, splits: dict[str, list[str]]) -> str:
    import datasets

    datasets.DatasetDict(
        {name: datasets.Dataset.from_list([{"prompt": p} for p in prompts]) for name, prompts in splits.items()}
    ).save_to_disk(str(path))
    return str(path)


def test_hf_directory_without_a_split_picks_train_and_test(tmp_path):
    d = _save(tmp_path / "ds", {"train": ["ab=", "cd="], "test": ["ef="]})
    assert [r.prompt for r in load_prompts(f"hf:{d}", "train")] == ["ab=", "cd="]
    assert [r.prompt for r in load_prompts(f"hf:{d}", "eval")] == ["ef="]
    assert [r.prompt for r in load_prompts(f"hf:{d}@train", "eval", limit=1)] == ["ab="]
    v = _save(tmp_path / "dv", {"train": ["ab="], "validation": ["gh="]})
    assert [r.prompt for r in load_prompts(f"hf:{v}", "eval")] == ["gh="]


def test_hf_directory_without_a_matching_split_says_how_to_choose(tmp_path):
    d = _save(tmp_path / "ds", {"train": ["ab="], "extra": ["cd="]})
    with pytest.raises(ValueError) as e:
        load_prompts(f"hf:{d}", "eval")
    assert "no eval/test/validation/valid split (it has train, extra)" in str(e.value)
    assert f"choose one with hf:{d}@<split>, e.g. hf:{d}@train" in str(e.value)
    assert [r.prompt for r in load_prompts(f"hf:{d}@extra", "eval")] == ["cd="]
    with pytest.raises(ValueError, match=f"no nope split .*choose one with hf:{d}@<split>"):
        load_prompts(f"hf:{d}@nope", "eval")
    o = _save(tmp_path / "do", {"test": ["ab="]})
    with pytest.raises(ValueError, match="no train split"):
        load_prompts(f"hf:{o}", "train")


class CharTokenizer:
    def __call__(self, text):
        return {"input_ids": list(range(len(text)))}


def _records(*prompts):
    return [PromptRecord(id=f"r{i}", prompt=p) for i, p in enumerate(prompts)]


def test_drop_overlong_filters_with_one_warning(caplog):
    recs = _records("abc", "abcdefgh", "ab", "abcdefghij", "abcdefg", "abcdefghijk")
    with caplog.at_level(logging.WARNING, logger="services.training.data"):
        kept = drop_overlong(recs, CharTokenizer(), 5, "filter")
    assert [r.id for r in kept] == ["r0", "r2"]
    assert len(caplog.records) == 1
    msg = caplog.records[0].getMessage()
    assert "4 of 6 training prompts" in msg and "prompt_length=5" in msg
    assert "'r1' (8 tokens)" in msg and "'r3'" in msg and "'r4'" in msg and "'r5'" not in msg
    caplog.clear()
    assert drop_overlong(recs[:1], CharTokenizer(), 5, "filter") == recs[:1] and not caplog.records


def test_drop_overlong_error_mode_and_all_overlong():
    recs = _records("abc", "abcdefgh")
    with pytest.raises(ValueError, match="1 of 2 held-out prompts .*'r1' \\(8 tokens\\).*data.overlong=filter"):
        drop_overlong(recs, CharTokenizer(), 5, "error", what="held-out")
    with pytest.raises(ValueError, match="2 of 2 training prompts.*none is left"):
        drop_overlong(recs, CharTokenizer(), 2, "filter")


def test_drop_overlong_counts_the_tokenizers_tokens(tiny_model_dir):
    from services.common.model_files import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    recs = _records("abc=", "abcd=")  # the tiny tokenizer adds a BOS token: 5 and 6 tokens
    assert [r.id for r in drop_overlong(recs, tok, 5, "filter")] == ["r0"]


def test_data_train_alone_holds_out_a_split_of_it_never_the_synthetic_task(tmp_path, caplog):
    """A config with data.train and no data.eval evaluates on a split of data.train that training
    never sees: the same prompts for every seed, repeated prompts on one side, said in the log."""
    from services.training.data import config_prompts

    rows = [{"prompt": f"What is {a} + {a + 1}?", "label": str(2 * a + 1)} for a in range(200)]
    rows += rows[:20]  # repeated prompts (a second copy of some)
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    splits = {}
    for seed in (0, 1):
        cfg = config_from_dict(
            {"data": {"train": str(data), "eval_size": 32}, "prompt_length": 512, "run": {"seed": seed}}
        )
        with caplog.at_level(logging.INFO, logger="services.training.data"):
            held = config_prompts(cfg, "eval", _whitespace_tokenizer())
            train = config_prompts(cfg, "train", _whitespace_tokenizer())
        splits[seed] = [r.prompt for r in held]
        assert len(held) == 32 and len(train) == len(rows) - sum(r["prompt"] in splits[seed] for r in rows)
        assert not {r.prompt for r in held} & {r.prompt for r in train}
        assert all(r.prompt.startswith("What is") for r in held)  # data.train's, not synthetic:reverse
    assert splits[0] == splits[1]
    assert "data.eval is not set: 32 of the 220 prompts" in caplog.text


def test_a_dataset_too_small_to_split_says_to_set_data_eval(tmp_path):
    from services.training.data import config_prompts

    data = tmp_path / "few.jsonl"
    data.write_text('{"prompt": "a", "label": "a"}\n{"prompt": "b", "label": "b"}\n')
    cfg = config_from_dict({"data": {"train": str(data)}})
    with pytest.raises(ValueError, match="too few to hold out a fifth for evaluation; set data.eval"):
        config_prompts(cfg, "eval", _whitespace_tokenizer())


def _whitespace_tokenizer():
    return lambda text: {"input_ids": text.split()}
