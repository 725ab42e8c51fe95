from services.common.model_files import load_tokenizer
from services.training.data import EpochSampler, load_prompts
from services.training.sources.synthetic import reverse_task


def test_tokenizer_roundtrip_and_chat_template(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    ids = tok("abc=")["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 5
    assert tok.decode(ids, skip_special_tokens=True) == "abc="
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "user: hi\nassistant: "


def test_train_and_held_out_prompts_are_disjoint():
    train = {r.prompt for r in reverse_task("train")}
    held = {r.prompt for r in reverse_task("eval")}
    assert train and held and not train & held
    assert all(r.label == r.prompt[:-1][::-1] for r in reverse_task("eval", 20))


def test_jsonl_prompts_with_messages_and_labels(tiny_model_dir, tmp_path):
    tok = load_tokenizer(tiny_model_dir)
    f = tmp_path / "p.jsonl"
    f.write_text(
        '{"prompt": "abc=", "label": "cba"}\n\n{"messages": [{"role": "user", "content": "x"}], "solution": 4}\n'
    )
    recs = load_prompts(str(f), "train", tok)
    assert [r.prompt for r in recs] == ["abc=", "user: x\nassistant: "] and [r.label for r in recs] == ["cba", "4"]


def test_epoch_sampler_uses_every_record_once_per_epoch():
    recs = reverse_task("train", 10)
    s = EpochSampler(recs, seed=0)
    first = s.take(10)
    assert sorted(r.id for r in first) == sorted(r.id for r in recs) and s.epoch == 0
    s.take(1)
    assert s.epoch == 1


def test_datasets_sources_parquet_csv_and_a_local_dataset_directory(tiny_model_dir, tmp_path):
    import datasets

    tok = load_tokenizer(tiny_model_dir)
    rows = [
        {"id": "q1", "messages": [{"role": "user", "content": "abc="}], "solution": "cba", "level": 2},
        {"id": "q2", "messages": [{"role": "user", "content": "de="}], "solution": "ed", "level": 1},
    ]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "p.parquet"))
    recs = load_prompts(str(tmp_path / "p.parquet"), "train", tok)
    assert [r.id for r in recs] == ["q1", "q2"] and [r.label for r in recs] == ["cba", "ed"]
    assert "abc=" in recs[0].prompt and recs[0].prompt != "abc="  # rendered through the chat template
    assert recs[0].metadata == {"level": 2}
    datasets.Dataset.from_list([{"question": "xy=", "answer": "yx"}] * 3).to_csv(str(tmp_path / "c.csv"))
    recs = load_prompts(str(tmp_path / "c.csv"), "train", tok, prompt_key="question", label_key="answer", limit=2)
    assert [(r.id, r.prompt, r.label) for r in recs] == [("c.csv:0", "xy=", "yx"), ("c.csv:1", "xy=", "yx")]
    d = tmp_path / "dsdir"
    d.mkdir()
    datasets.Dataset.from_list([{"prompt": "gh="}]).to_parquet(str(d / "test.parquet"))
    recs = load_prompts(f"hf:{d}@test", "train", tok)
    assert [r.prompt for r in recs] == ["gh="] and recs[0].label is None
