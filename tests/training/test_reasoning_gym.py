"""reasoning-gym tasks as prompts (`data.train: reasoning-gym:NAME?size=N&seed=S&OPTION=VALUE`) and
the task's own scorer as the `reasoning_gym` reward rule: items load as the package makes them,
the held-out items never ask a training question, the rule scores the item's own answer 1.0
after the metadata's trip through JSON (the replay buffer, the reward service), and a mistake in
the source is a config error naming data.train."""

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

reasoning_gym = pytest.importorskip("reasoning_gym")

from services.common import reasoning_gym_tasks as gym  # noqa: E402
from services.common.config import ConfigError, config_from_dict  # noqa: E402
from services.common.replay.records import make_task, task_record  # noqa: E402
from services.reward.functions import RewardFunction, rule_errors  # noqa: E402
from services.reward.rules import RULES  # noqa: E402
from services.training.data import config_prompts, data_source_errors, load_prompts  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# two 1-digit terms: a few hundred distinct questions, so 300 training items and 100 held out collide
NARROW = "reasoning-gym:basic_arithmetic?size=300&max_terms=2&max_digits=1"


@pytest.fixture(scope="module")
def tokenizer():
    from services.cli.tiny import build_tokenizer

    return build_tokenizer()


def _cfg(**data) -> object:
    return config_from_dict({"data": data, "prompt_length": 1024})


def _score(record, response: str, **kwargs) -> float:
    """The rule through the registry, as the reward service calls it, on the record's metadata after
    a JSON round trip."""
    fn = RewardFunction.build("reasoning_gym", kwargs, RULES)
    from services.common.types import RewardSample

    meta = json.loads(json.dumps(record.metadata))
    return fn([RewardSample(record.prompt, response, record.label, meta)])[0]


def test_a_task_loads_with_its_size_seed_and_config():
    records = load_prompts("reasoning-gym:leg_counting?size=12&seed=3&min_animals=2&max_animals=2", "train")
    made = reasoning_gym.create_dataset("leg_counting", seed=3, size=12, min_animals=2, max_animals=2)
    assert [(r.prompt, r.label) for r in records] == [(e["question"], e["answer"]) for e in made]
    assert len({r.id for r in records}) == 12 and records[0].id == "leg_counting-3-0"
    carried = records[5].metadata[gym.METADATA_KEY]
    assert {k: carried[k] for k in ("task", "seed", "size", "index")} == {
        "task": "leg_counting",
        "seed": 3,
        "size": 12,
        "index": 5,
    }
    assert carried["config"] == {"max_animals": 2, "min_animals": 2} and carried["metadata"]["num_animals"] == 2
    again = load_prompts("reasoning-gym:leg_counting?size=12&seed=3&min_animals=2&max_animals=2", "train")
    assert [r.prompt for r in again] == [r.prompt for r in records]  # deterministic
    other = load_prompts("reasoning-gym:leg_counting?size=12&seed=4&min_animals=2&max_animals=2", "train")
    assert [r.prompt for r in other] != [r.prompt for r in records]
    assert len(load_prompts("reasoning-gym:leg_counting", "train", limit=5)) == 5


def test_the_source_options_parse_as_yaml_values():
    spec = gym.parse_source("reasoning-gym:basic_arithmetic?size=20&seed=7&operators=[+, -]&allow_negation=false")
    assert (spec.task, spec.size, spec.seed) == ("basic_arithmetic", 20, 7)
    assert spec.config == {"operators": ["+", "-"], "allow_negation": False}
    records = load_prompts("reasoning-gym:basic_arithmetic?size=20&operators=[+, -]&allow_negation=false", "train")
    assert all("*" not in r.prompt and "/" not in r.prompt for r in records)


def test_string_prompts_go_through_the_chat_template_when_it_is_on(tokenizer):
    plain = config_prompts(_cfg(train="reasoning-gym:leg_counting?size=4"), "train", tokenizer)
    templated = config_prompts(
        _cfg(train="reasoning-gym:leg_counting?size=4", chat_template=True, system_prompt="Answer in <answer> tags."),
        "train",
        tokenizer,
    )
    assert templated[0].prompt == f"system: Answer in <answer> tags.\nuser: {plain[0].prompt}\nassistant: "
    assert templated[0].metadata == plain[0].metadata


def test_held_out_items_never_ask_a_training_question(tokenizer, caplog):
    cfg = _cfg(train=NARROW, eval_size=100)
    with caplog.at_level(logging.INFO, logger="services.training.data"):
        train = config_prompts(cfg, "train", tokenizer)
        held = config_prompts(cfg, "eval", tokenizer)
    assert len(train) == 300 and len(held) == 100
    assert {r.prompt for r in train}.isdisjoint(r.prompt for r in held)
    seeds = {r.metadata[gym.METADATA_KEY]["seed"] for r in held}
    assert seeds == {gym.DEFAULT_SEED + gym.HELD_OUT_SEED_OFFSET}
    dropped = [m for m in caplog.messages if "whose question a training item of" in m]
    assert dropped, caplog.messages  # the narrow task did collide, and the drop was logged
    assert int(dropped[0].split(": dropped ")[1].split()[0]) > 0
    assert "data.eval is not set: 100 held-out items" in caplog.text


def test_the_held_out_seed_follows_the_training_seed(tokenizer):
    cfg = _cfg(train="reasoning-gym:leg_counting?size=50&seed=5", eval_size=8)
    held = config_prompts(cfg, "eval", tokenizer)
    assert {r.metadata[gym.METADATA_KEY]["seed"] for r in held} == {5 + gym.HELD_OUT_SEED_OFFSET}


def test_an_explicit_eval_of_the_same_task_keeps_the_rule(tokenizer):
    train = config_prompts(_cfg(train=NARROW), "train", tokenizer)
    questions = {r.prompt for r in train}
    same = config_prompts(
        _cfg(train=NARROW, eval="reasoning-gym:basic_arithmetic?max_terms=2&max_digits=1"), "eval", tokenizer
    )
    assert same and questions.isdisjoint(r.prompt for r in same)
    seeded = config_prompts(
        _cfg(train=NARROW, eval=NARROW.replace("size=300", "seed=9"), eval_size=64), "eval", tokenizer
    )
    assert len(seeded) == 64 and questions.isdisjoint(r.prompt for r in seeded)
    assert {r.metadata[gym.METADATA_KEY]["seed"] for r in seeded} == {9}
    with pytest.raises(ValueError, match="every held-out item of .* asks a question a training item"):
        config_prompts(_cfg(train=NARROW, eval=NARROW + "&seed=0"), "eval", tokenizer)


@pytest.mark.parametrize(
    "source",
    [
        "reasoning-gym:leg_counting?size=6",
        "reasoning-gym:basic_arithmetic?size=6",
        "reasoning-gym:spell_backward?size=6",
        "reasoning-gym:arc_agi?size=3",  # its scorer compares tuples in the item's metadata
        "reasoning-gym:word_sorting?size=6",
    ],
)
def test_the_rule_scores_the_items_own_answer_one_and_a_wrong_one_less(source):
    for r in load_prompts(source, "train"):
        assert _score(r, r.label) == 1.0, r.id
        assert _score(r, f"Let me think. <answer> {r.label} </answer>") == 1.0, r.id
        assert _score(r, "<answer>zzz</answer>") < 1.0
        assert _score(r, f"x{r.label}") < 1.0


def test_the_rule_finds_the_answer_as_reasoning_gym_asks_for_it():
    from reasoning_gym.utils import extract_answer

    for text in ("a <answer>1</answer> b <answer> 2 </answer>", "<answer>\nx y\n</answer>", "no tags", ""):
        if extract_answer(text) is not None:
            assert gym.extract_answer(text) == extract_answer(text)
    assert gym.extract_answer("  the whole response \n") == "the whole response"
    assert gym.extract_answer("no tags", require_tag=True) is None
    assert gym.extract_answer("so <answer> 42") == "42"  # cut off before its closing tag
    (r,) = load_prompts("reasoning-gym:leg_counting?size=1", "train")
    assert _score(r, r.label, require_tag=True) == 0.0 and _score(r, f"<answer>{r.label}</answer>", require_tag=True)


def test_a_task_without_a_single_answer_is_scored_by_its_scorer():
    (r,) = load_prompts("reasoning-gym:propositional_logic?size=1", "train")
    assert r.label is None
    assert 0.0 <= _score(r, "P") < 1.0


def test_a_scorer_that_raises_on_what_a_model_wrote_scores_zero(caplog):
    (r,) = load_prompts("reasoning-gym:prime_factorization?size=1", "train")
    with caplog.at_level(logging.WARNING):
        assert _score(r, "1/0") == 0.0
    assert _score(r, r.label) == 1.0


def test_metadata_survives_json_and_the_replay_buffer():
    for r in load_prompts("reasoning-gym:leg_counting?size=3", "train") + load_prompts(
        "reasoning-gym:arc_agi?size=2", "train"
    ):
        assert json.loads(json.dumps(r.metadata)) == r.metadata  # JSON values only
        back = task_record(make_task(r, epoch=0, policy_version=0, min_version=0, group_size=1))
        assert back == r
    entry = reasoning_gym.create_dataset("arc_agi", seed=0, size=1)[0]
    assert isinstance(entry["metadata"]["output"], tuple)
    assert gym.from_json(json.loads(json.dumps(gym.to_json(entry["metadata"])))) == entry["metadata"]
    odd = {"t": (1, (2, 3)), 4: "int key", (1, 2): [()], "__tuple__": "a key like a tag"}
    assert gym.from_json(json.loads(json.dumps(gym.to_json(odd)))) == odd


def test_an_item_too_big_to_carry_is_generated_again_to_score(monkeypatch):
    monkeypatch.setattr(gym, "MAX_ENTRY_CHARS", 10)
    records = load_prompts("reasoning-gym:leg_counting?size=2&seed=11", "train")
    assert all("metadata" not in r.metadata[gym.METADATA_KEY] for r in records)
    assert [_score(r, r.label) for r in records] == [1.0, 1.0]


@pytest.mark.parametrize(
    "source,message",
    [
        (
            "reasoning-gym:leg_countin",
            "data.train: unknown reasoning-gym task 'leg_countin'; did you mean leg_counting",
        ),
        ("reasoning-gym:leg_counting?legs=3", "data.train: reasoning-gym task 'leg_counting' has no option 'legs'"),
        ("reasoning-gym:leg_counting?size=0", "size must be a whole number >= 1, not 0"),
        ("reasoning-gym:leg_counting?seed", "option 'seed' is not KEY=VALUE"),
        ("reasoning-gym:leg_counting?min_animals=9&max_animals=2", "refuses its config"),
        ("reasoning-gym:", "names no task"),
    ],
)
def test_a_mistake_in_the_source_is_a_config_error(source, message):
    with pytest.raises(ConfigError) as e:
        config_from_dict({"data": {"train": source}})
    assert len(e.value.errors) == 1 and message in e.value.errors[0], e.value.errors


def test_an_unknown_task_lists_valid_ones_and_fails_config_validate():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"data": {"eval": "reasoning-gym:nope"}})
    assert e.value.errors == [
        f"data.eval: unknown reasoning-gym task 'nope'; {len(gym.task_names())} tasks, e.g. leg_counting, "
        "basic_arithmetic, chain_sum, gsm_symbolic, spell_backward"
    ]
    r = subprocess.run(
        [sys.executable, "-m", "services.cli", "config", "validate", "configs/tiny-cpu.yaml", "--set",
         "data.train=reasoning-gym:leg_countin?size=10"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )  # fmt: skip
    assert r.returncode == 2
    assert "data.train=reasoning-gym:leg_countin?size=10: unknown reasoning-gym task 'leg_countin'; did you mean" in (
        r.stderr
    ), r.stderr


def test_without_the_package_a_config_loads_and_the_data_check_says_to_install_it(monkeypatch):
    monkeypatch.setattr(gym, "available", lambda: False)
    cfg = config_from_dict({"data": {"train": "reasoning-gym:leg_countin"}})  # the task cannot be checked
    assert data_source_errors(cfg) == [
        f"data.train: reasoning-gym:leg_countin needs the reasoning-gym package: {gym.INSTALL}"
    ]
    with pytest.raises(ConfigError, match="size must be a whole number"):  # its syntax still can
        config_from_dict({"data": {"train": "reasoning-gym:leg_counting?size=-1"}})


def test_sources_and_the_rule_pass_the_pre_flight_checks():
    cfg = config_from_dict(
        {
            "data": {"train": "reasoning-gym:leg_counting?size=8", "eval": "reasoning-gym:chain_sum"},
            "reward": {"rules": [{"name": "reasoning_gym"}], "eval_rules": [{"name": "reasoning_gym"}]},
        }
    )
    assert data_source_errors(cfg, "reward.rules[0] (reasoning_gym)") == []
    assert rule_errors(cfg.reward.rules, RULES) == []
    bad = [type("Spec", (), {"name": "reasoning_gym", "kwargs": {"require_tag": "yes"}})()]
    assert rule_errors(bad, RULES) == [
        "reward.rules[0].kwargs: reward rule 'reasoning_gym' with kwargs {'require_tag': 'yes'}: "
        "require_tag must be true or false, not 'yes'"
    ]
    # a sample of another source: reasoning-gym's plain comparison with the label
    fn = RewardFunction.build("reasoning_gym", {}, RULES)
    from services.common.types import RewardSample

    assert fn([RewardSample("abc=", "cba", "cba"), RewardSample("abc=", "xx", "cba")]) == [1.0, 0.0]


def test_train_local_on_a_task_reports_held_out_metrics(tiny_model_dir, tmp_path):
    """`rlhf train --local` for 2 iterations on the tiny model with a reasoning-gym task and its rule:
    it runs, evaluates the held-out items and writes what it scored (not a learning test)."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "train",
            "--local",
            "-c",
            str(ROOT / "configs" / "tiny-cpu.yaml"),
            "--run-dir",
            str(tmp_path / "run"),
            "--set",
            f"model.path={tiny_model_dir}",
            "--set",
            "data.train=reasoning-gym:basic_arithmetic?size=64&max_terms=2&max_digits=1",
            "--set",
            "data.eval=null",
            "--set",
            "data.eval_size=16",
            "--set",
            "prompt_length=48",
            "--set",
            "reward.rules=[{name: reasoning_gym}]",
            "--set",
            "run.iterations=2",
            "--set",
            "run.eval_interval=1",
            "--set",
            "rollout_batch_size=8",
            "--set",
            "ppo_mini_batch_size=8",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "iter    2/2  reward" in r.stdout and "done: held-out reward" in r.stdout, r.stdout
    assert "data.eval is not set: 16 held-out items of reasoning-gym:basic_arithmetic" in r.stderr
    rows = [json.loads(x) for x in (tmp_path / "run" / "generations" / "iter_000002.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and all(row["id"].startswith("basic_arithmetic-1000003-") for row in rows)
    assert all(set(row["components"]) == {"reasoning_gym"} for row in rows)
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("reward/reasoning_gym" in m for m in metrics)
    assert any(k.startswith("eval/") for m in metrics for k in m), sorted({k for m in metrics for k in m})
