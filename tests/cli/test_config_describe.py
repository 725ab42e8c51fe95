from typing import Literal, get_args, get_origin

import pytest
from pydantic import BaseModel

from services.cli.config_docs import describe_config
from services.common.config import Config

# the generated configuration reference page (docs/configuration.md) is checked in tests/docs


def _models(model: type[BaseModel]) -> list[type[BaseModel]]:
    """`model` and every model its fields hold, directly or as list items."""
    out = [model]
    for field in model.model_fields.values():
        inner = get_args(field.annotation)[0] if get_origin(field.annotation) is list else field.annotation
        if isinstance(inner, type) and issubclass(inner, BaseModel) and inner not in out:
            out += [m for m in _models(inner) if m not in out]
    return out


def _leaf_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        a = field.annotation
        if isinstance(a, type) and issubclass(a, BaseModel):
            keys += _leaf_keys(a, f"{prefix}{name}.")
            continue
        keys.append(prefix + name)
        if get_origin(a) is list and isinstance(get_args(a)[0], type) and issubclass(get_args(a)[0], BaseModel):
            keys += _leaf_keys(get_args(a)[0], f"{prefix}{name}[].")
    return keys


def _markdown_rows() -> dict[str, list[str]]:
    lines = describe_config("markdown").splitlines()
    assert lines[0] == "| key | default | options | meaning |" and lines[1] == "| --- | --- | --- | --- |"
    rows = [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[2:]]
    assert all(len(r) == 4 for r in rows)
    return {r[0]: r for r in rows}


def test_every_config_field_has_a_description():
    models = _models(Config)
    names = {m.__name__ for m in models}
    assert {"ModelConfig", "LoraConfig", "RuleSpec", "RewardEndpoint", "LearnerEndpoint", "RPCConfig"} <= names
    missing = [
        f"{m.__name__}.{n}" for m in models for n, f in m.model_fields.items() if not (f.description or "").strip()
    ]
    assert not missing, f"fields without a description: {missing}"


def test_the_table_has_one_row_per_leaf_key():
    lines = describe_config("markdown").splitlines()[2:]
    keys = [line.strip("|").split(" | ")[0].strip() for line in lines]
    assert keys == _leaf_keys(Config)
    assert {
        "generation.temperature",
        "rpc.reward.http_port",
        "model.lora.rank",
        "reward.rules",
        "reward.rules[].name",
        "data.overlong",
    } <= set(keys)
    rows = _markdown_rows()
    assert all(row[3] for row in rows.values())
    assert rows["generation.temperature"][1:3] == ["1.0", "(0, 10]"]
    assert rows["rpc.reward.http_port"][1:3] == ["8052", "[0, 65535] or null"]
    assert rows["rpc.generation.port"][1] == "50051" and rows["reward.rules[].name"][1] == "required"
    assert rows["adam_betas"][1] == "[0.9, 0.999]" and rows["model.bf16"][1] == "false"


def test_the_options_column_lists_every_literal_choice():
    rows = _markdown_rows()
    checked = 0
    for model in _models(Config):
        for name, field in model.model_fields.items():
            args = get_args(field.annotation)
            literal = next((a for a in (field.annotation, *args) if get_origin(a) is Literal), None)
            if literal is None:
                continue
            keys = [k for k in rows if k == name or k.endswith("." + name)]  # dtype: generation's, distill's
            choices = [*map(str, get_args(literal)), *(["null"] if type(None) in args else [])]
            assert any(rows[k][2] == ", ".join(choices) for k in keys), (name, keys)
            checked += 1
    assert checked >= 8
    assert rows["reward_norm"][2] == "batch, group, running, null"
    assert rows["adv_estimator"][2] == ", ".join(get_args(Config.model_fields["adv_estimator"].annotation))


def test_text_format_is_an_aligned_table():
    lines = describe_config("text").splitlines()
    assert len(lines) == 1 + len(_leaf_keys(Config))
    col = lines[0].index("default")
    assert lines[0].startswith("key ") and all(line[col - 2 : col] == "  " for line in lines)
    assert lines[1].split()[:3] == ["rollout_batch_size", "512", ">"]
    with pytest.raises(ValueError, match="markdown, text"):
        describe_config("html")
