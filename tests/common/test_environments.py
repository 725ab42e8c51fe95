"""The one registry of environment kinds (services/common/environments.py): every reference goes
to its kind by the registry, config validation checks its syntax there, an unknown kind is refused
by name with the kinds known, and a new kind is one file and one registration: config validation,
the pre-flight, the agent host and the prompt loader all reach it without another edit."""

import pytest

from services.agents.host import load_agent
from services.cli.preflight import agent_errors
from services.common import environments
from services.common.config import ConfigError, config_from_dict
from services.common.model_files import load_tokenizer
from services.training.data import config_prompts


def test_each_reference_goes_to_its_kind():
    kind = environments.kind_of
    assert kind("openenv+http://127.0.0.1:8000").name == "openenv"
    assert kind("openenv:envs/reverse.py:ReverseEnvironment").name == "openenv"
    assert kind("verifiers:vf_reverse_env.py:load_environment").name == "verifiers"
    assert kind("verifiers:ENV_ID").name == "verifiers"
    assert kind("examples/agents/sum_env.py:SumEnv").name == "python"
    assert kind("my_package.envs:SumEnv").name == "python"


@pytest.mark.parametrize("ref", ["gymnasium+http://127.0.0.1:9/", "nemo://host:1/env", "openenv2+ws://h:1"])
def test_an_unknown_kind_is_refused_by_name_with_the_kinds_known(ref):
    with pytest.raises(ValueError) as e:
        environments.kind_of(ref)
    head = ref.split(":", 1)[0]
    assert f"no environment kind {head!r}" in str(e.value)
    assert all(k.syntax in str(e.value) for k in environments.KINDS)
    with pytest.raises(ConfigError, match="no environment kind"):
        config_from_dict({"rollout": {"environment": ref}})


def test_config_validation_asks_each_kind_for_its_syntax():
    with pytest.raises(ConfigError, match="unknown option 'colour'"):
        config_from_dict({"rollout": {"environment": "openenv+http://127.0.0.1:8000?colour=red"}})
    with pytest.raises(ConfigError, match="option 'n' is not KEY=VALUE"):
        config_from_dict({"rollout": {"environment": "verifiers:env.py:load_environment?n"}})
    with pytest.raises(ConfigError, match="give 'path/to/file.py:Class'"):
        config_from_dict({"rollout": {"environment": "just_a_name"}})


def test_a_new_kind_is_one_file_and_one_registration(monkeypatch, tiny_model_dir):
    kind = environments.EnvironmentKind("echo", ("echo:",), "echo:WORD", "tests.common.echo_kind", source="echo")
    monkeypatch.setattr(environments, "KINDS", (kind, *environments.KINDS))
    with pytest.raises(ConfigError, match="give echo:WORD"):  # config validation asks it
        config_from_dict({"rollout": {"environment": "echo:not a word"}})
    with pytest.raises(ConfigError, match="takes the prompts of a echo environment"):  # and its source
        config_from_dict({"data": {"train": "echo"}})
    cfg = config_from_dict(
        {
            "model": {"path": tiny_model_dir},
            "rollout": {"environment": "echo:abcdefghij"},
            "data": {"train": "echo", "eval": "echo", "eval_size": 2},
        }
    )
    assert agent_errors(cfg) == []  # the pre-flight loads it
    assert callable(load_agent(cfg.rollout))  # the agent host plays it
    tok = load_tokenizer(tiny_model_dir)
    train = config_prompts(cfg, "train", tok)  # the prompt loader takes its prompts
    held = config_prompts(cfg, "eval", tok)
    assert (
        sorted(r.prompt for r in train + held) == [f"{c}=" for c in "abcdefghij"] and held
    )  # some held out, never trained on
    assert not {r.prompt for r in held} & {r.prompt for r in train}
