import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.common.config import Config, ConfigError, config_from_dict, load_config

ROOT = Path(__file__).resolve().parents[2]
PRESETS = ROOT / "configs"
SEED_DEFAULTS = {
    "rollout_batch_size": 512,
    "prompt_length": 2048,
    "response_length": 4096,
    "adv_estimator": "gae",
    "num_return_sequences_in_group": 1,
    "ppo_epochs": 1,
    "use_kl_loss": True,
    "kl_loss_coef": 0.001,
    "loss_agg_mode": "seq-mean-token-sum",
    "whiten_advantages": True,
    "advantage_clip": 2.0,
    "reward_clip": None,
    "dual_clip_loss": True,
    "lambd": 0.95,
    "gamma": 1.0,
    "pg_clip": 0.2,
    "value_clip": None,
    "kl_penalty": "kl",
    "target_kl": None,
    "init_kl_coef": 0.2,
    "kl_horizon": 10000,
    "add_token_level_kl": False,
    "reward_norm": None,
    "reward_shift": False,
    "reward_scale": False,
}


def test_defaults_are_the_seed_table():
    cfg = Config()
    for key, value in SEED_DEFAULTS.items():
        assert getattr(cfg, key) == value, key


def test_seed_block_validates_unchanged():
    text = (ROOT / "configs" / "seed-ppo.yaml").read_text()
    raw = yaml.safe_load(text)
    assert set(raw) == set(SEED_DEFAULTS)
    cfg = load_config(ROOT / "configs" / "seed-ppo.yaml")
    assert cfg.model_dump(include=set(SEED_DEFAULTS)) == SEED_DEFAULTS


@pytest.mark.parametrize("name", ["tiny-cpu.yaml", "seed-ppo.yaml"])
def test_shipped_configs_validate(name):
    load_config(ROOT / "configs" / name)


def test_unknown_keys_name_the_closest_key():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"gama": 0.9, "model": {"pth": "x"}})
    errors = "\n".join(e.value.errors)
    assert "gama: unknown key; did you mean 'gamma'?" in errors
    assert "model.pth: unknown key; did you mean 'model.path'?" in errors


@pytest.mark.parametrize(
    "data,fragment",
    [
        ({"gamma": 1.5}, "gamma"),
        ({"lambd": -0.1}, "lambd"),
        ({"loss_agg_mode": "token-sum"}, "allowed: 'token-mean'"),
        ({"adv_estimator": "ppo"}, "adv_estimator"),
        ({"kl_penalty": "kl2"}, "kl_penalty"),
        ({"reward_norm": "global"}, "reward_norm"),
        ({"rollout_batch_size": 0}, "rollout_batch_size"),
        ({"adv_estimator": "grpo"}, "num_return_sequences_in_group >= 2"),
        ({"dual_clip_c": 1.0}, "dual_clip_c"),
    ],
)
def test_out_of_range_values_are_errors(data, fragment):
    with pytest.raises(ConfigError, match=fragment):
        config_from_dict(data)


def test_every_error_is_reported_at_once():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"gamma": 2, "lambd": 3, "pg_clip": -1})
    assert len(e.value.errors) == 3


def test_overrides_typed_and_nested():
    cfg = config_from_dict(
        {}, ["pg_clip=0.1", "run.seed=7", "reward_clip=~", "model.lora.rank=8", "adam_betas=[0.8, 0.9]"]
    )
    assert cfg.pg_clip == 0.1 and cfg.run.seed == 7 and cfg.reward_clip is None
    assert cfg.model.lora.rank == 8 and cfg.adam_betas == (0.8, 0.9)
    with pytest.raises(ConfigError, match="key=value"):
        config_from_dict({}, ["pg_clip"])


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True, text=True, cwd=ROOT)


def test_cli_validate_prints_resolved_yaml():
    r = _cli("config", "validate", "configs/seed-ppo.yaml", "--set", "ppo_epochs=4")
    assert r.returncode == 0, r.stderr
    resolved = yaml.safe_load(r.stdout)
    assert resolved["ppo_epochs"] == 4 and resolved["lambd"] == 0.95 and "model" in resolved


def test_cli_validate_errors_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("gama: 0.9\ngamma: 1.5\nloss_agg_mode: sum\n")
    r = _cli("config", "validate", str(bad))
    assert r.returncode == 2
    assert "did you mean 'gamma'" in r.stderr and "gamma:" in r.stderr and "loss_agg_mode" in r.stderr
    r = _cli("config", "validate", str(tmp_path / "missing.yaml"))
    assert r.returncode == 2 and "no such config file" in r.stderr


def test_a_config_layered_on_a_preset_with_base(tmp_path, monkeypatch):
    """`base: smollm2-cpu` starts from the preset; the file's sections merge key by key, lists are
    replaced; a base may be a path from the file's directory, and may have a base of its own."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.yaml").write_text(
        "base: smollm2-cpu\nmodel: {bf16: true}\nreward:\n  rules:\n    - {name: exact_match}\nrun: {iterations: 5}\n"
    )
    cfg = load_config(tmp_path / "mine.yaml")
    preset = load_config(PRESETS / "smollm2-cpu.yaml")
    assert cfg.model.bf16 is True and cfg.model.path == preset.model.path  # merged into the section
    assert cfg.run.iterations == 5 and cfg.run.eval_interval == preset.run.eval_interval
    assert [r.name for r in cfg.reward.rules] == ["exact_match"]  # the list replaced, not appended
    assert cfg.rollout_batch_size == preset.rollout_batch_size == 16
    assert cfg.data.eval == preset.data.eval == "synthetic:arithmetic"
    # your own training prompts without held-out ones: a split of yours, not the preset's task
    (tmp_path / "data.yaml").write_text("base: smollm2-cpu\ndata: {train: mine.jsonl}\n")
    assert load_config(tmp_path / "data.yaml").data.eval is None
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "child.yaml").write_text("base: ../mine.yaml\nrun: {iterations: 7}\n")
    child = load_config(tmp_path / "sub" / "child.yaml")
    assert child.run.iterations == 7 and child.model.bf16 is True and child.rollout_batch_size == 16
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="leads back to itself"):
        load_config(tmp_path / "loop.yaml")
    (tmp_path / "none.yaml").write_text("base: smollm9\n")
    with pytest.raises(ConfigError, match="'smollm9' is no file here and no preset; presets: .*smollm2-cpu"):
        load_config(tmp_path / "none.yaml")
