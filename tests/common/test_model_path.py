import shutil
from pathlib import Path

import pytest

from services.common.model_files import check_model_dir, load_tokenizer
from services.common.modeling import ValueModel


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An empty hub cache in tmp_path with HF_HUB_OFFLINE set (huggingface_hub reads both at import,
    so its constants are patched too)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_a_local_model_directory_is_returned_as_a_path(tiny_model_dir):
    assert str(check_model_dir(tiny_model_dir)) == tiny_model_dir
    assert check_model_dir(Path(tiny_model_dir)) == Path(tiny_model_dir)


@pytest.mark.parametrize("name", ["/no/such/model", "./no-such-model", "~/no-such-model", "a/b/c"])
def test_a_missing_local_path_says_how_to_build_the_tiny_model(name, offline_hub):
    with pytest.raises(FileNotFoundError, match="config.json missing.*rlhf init-model --out"):
        check_model_dir(name)


def test_an_unreachable_hub_id_says_so(offline_hub):
    for load in (check_model_dir, load_tokenizer):
        with pytest.raises(FileNotFoundError) as e:
            load("Qwen/Qwen2.5-0.5B-Instruct")
        msg = str(e.value)
        assert (
            "model 'Qwen/Qwen2.5-0.5B-Instruct' is neither a local directory nor reachable on the Hugging Face hub"
            in msg
        )
        assert "HF_HOME" in msg and "init-model --out Qwen" not in msg


def test_a_cached_hub_snapshot_is_used(tiny_model_dir, offline_hub):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = offline_hub / "models--acme--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    shutil.copytree(tiny_model_dir, snapshot)
    assert check_model_dir("acme/tiny") == snapshot
    tok = load_tokenizer("acme/tiny")
    assert tok.decode(tok("abc=")["input_ids"], skip_special_tokens=True) == "abc="
    assert ValueModel.from_pretrained("acme/tiny").value_head.out_features == 1


def test_named_tensors_are_read_from_the_files_as_the_model_loads_them(tiny_model_dir, tmp_path):
    """read_state: the state dict's tensors by name (the tied unembedding read as the embedding),
    equal to the loaded model's; a directory of another format (a pickled .bin) gives None."""
    import torch

    from services.common.model_files import load_causal_lm, read_state, state_names

    model = load_causal_lm(tiny_model_dir)
    loaded = model.state_dict()
    assert state_names(tiny_model_dir) == set(loaded)
    names = {"lm_head.weight", "model.layers.0.self_attn.q_proj.weight"}
    got = read_state(tiny_model_dir, names)
    assert got is not None and set(got) == names
    assert all(torch.equal(got[n], loaded[n]) for n in names)
    every = read_state(tiny_model_dir, set(loaded))
    assert every is not None and all(torch.equal(every[n], loaded[n]) for n in loaded)
    assert read_state(tiny_model_dir, {"no.such.weight"}) is None
    (tmp_path / "bin").mkdir()
    torch.save(loaded, tmp_path / "bin" / "pytorch_model.bin")
    shutil.copy(Path(tiny_model_dir) / "config.json", tmp_path / "bin" / "config.json")
    assert read_state(tmp_path / "bin", names) is None
