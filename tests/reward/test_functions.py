"""Your reward function by file path or module, in its three signatures; what `config validate`
says of each mistake; an exception in it stops `train --local` with its own traceback."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from services.common.types import RewardSample
from services.common.userfn import load_function
from services.reward.functions import RewardFunction, RewardFunctionError
from services.reward.rules import RULES
from services.reward.scorer import RuleScorer

ROOT = Path(__file__).resolve().parents[2]

USER_CODE = textwrap.dedent("""
    import helper  # a neighbour of this file: the file's own directory is importable

    def score(prompt, response, label, metadata, bonus=0.0):
        return float(response == label) + bonus

    def batched(prompts, completions, label, **columns):
        return [float(c == l) + len(columns["topic"][i]) for i, (c, l) in enumerate(zip(completions, label))]

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": float(solution_str in ground_truth["answers"]) + (extra_info or {}).get("w", 0),
                "acc": 1.0}

    def boom(prompt, response, label, metadata):
        return helper.divide(1, 0)

    def short(prompts, completions, **kw):
        return [1.0]

    def two_args(a, b):
        return 0.0
""")


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    (tmp_path / "rewards.py").write_text(USER_CODE)
    (tmp_path / "helper.py").write_text("def divide(a, b):\n    return a / b\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("rewards", "helper"):
        sys.modules.pop(name, None)
    return tmp_path


SAMPLES = [
    RewardSample("p", "4", "4", {"topic": "ab", "extra_info": {"w": 0.5}}),
    RewardSample("p", "5", "4", {"topic": ""}),
]
# a label stored as a structure (verl's reward_model.ground_truth): its JSON is the label string
STRUCTURED = [
    RewardSample("p", "four", json.dumps(t), {"ground_truth": t, "extra_info": {"w": 0.5}})
    for t in ({"answers": ["4", "four"]}, {"answers": ["4"]})
]


def test_the_three_signatures_by_file_path_and_by_module(user_dir):
    by_path = RewardFunction.build("./rewards.py:score", {"bonus": 0.25}, RULES)
    by_module = RewardFunction.build("rewards:score", {}, RULES)
    assert by_path.kind == by_module.kind == "sample"
    assert by_path(SAMPLES) == [1.25, 0.25] and by_module(SAMPLES) == [1.0, 0.0]
    batched = RewardFunction.build(str(user_dir / "rewards.py") + ":batched", {}, RULES)  # absolute path
    assert batched.kind == "batched" and batched(SAMPLES) == [3.0, 0.0]
    verl = RewardFunction.build("rewards.py:compute_score", {}, RULES)
    # the structured ground truth reaches verl's function as stored (a dict), extra_info too
    assert verl.kind == "verl" and verl(STRUCTURED) == [1.5, 0.5]


def test_an_exception_inside_is_a_reward_function_error_with_its_traceback(user_dir):
    rule = RewardFunction.build("rewards.py:boom", {}, RULES)
    with pytest.raises(RewardFunctionError) as e:
        RuleScorer([("rewards.py:boom", 1.0, {})]).score(SAMPLES)
    assert "raised ZeroDivisionError" in str(e.value)
    assert "helper.py" in e.value.tb and "return a / b" in e.value.tb  # the user's own frames
    assert rule.name == "rewards.py:boom"
    with pytest.raises(RewardFunctionError, match="returned list of 1 values for 2 samples"):
        RewardFunction.build("rewards.py:short", {}, RULES)(SAMPLES)


def test_over_grpc_it_is_failed_precondition_with_its_reason(user_dir, tiny_model_dir):
    """The worker and the learner stop the run on `Reason.REWARD_FUNCTION_FAILED` (not on the
    message); the details carry the function's traceback for the person reading the log."""
    import grpc

    from services.common.config import config_from_dict
    from services.common.rpc.errors import Reason, reason_of
    from services.reward.client import RewardClient
    from services.reward.server import serve

    cfg = config_from_dict(
        {
            "model": {"path": tiny_model_dir, "device": "cpu"},
            "reward": {"type": "rules", "rules": [{"name": "rewards.py:boom"}]},
            "rpc": {"reward": {"port": 0, "metrics_port": None, "http_port": None}},
        }
    )
    with serve(cfg) as svc:
        with pytest.raises(grpc.RpcError) as e:
            RewardClient(f"127.0.0.1:{svc.server.port}", cfg.rpc).score(SAMPLES)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert reason_of(e.value) is Reason.REWARD_FUNCTION_FAILED
    assert "return a / b" in e.value.details()


def test_a_builtin_rules_complaint_about_a_sample_stays_a_value_error():
    with pytest.raises(ValueError, match="needs a label") as e:
        RewardFunction.build("exact_match", {}, RULES)([RewardSample("p", "r")])
    assert not isinstance(e.value, RewardFunctionError)


@pytest.mark.parametrize(
    "ref, message",
    [
        ("no_such_module:score", "cannot be imported: No module named 'no_such_module'"),
        ("missing.py:score", "no such file missing.py"),
        ("rewards.py:nothing", "has no 'nothing'"),
    ],
)
def test_what_cannot_be_loaded_says_why(user_dir, ref, message):
    with pytest.raises(ValueError, match=message):
        load_function(ref)


def test_config_validate_reports_every_mistake_in_one_run_naming_each_key(user_dir):
    (user_dir / "c.yaml").write_text(
        textwrap.dedent("""
        gama: 1.5
        data: {train: nothere.jsonl}
        reward:
          rules:
            - {name: exact_matc}
            - {name: no_such_module:score}
            - {name: math_answer, kwargs: {mode: flexibel}}
            - {name: exact_match, kwargs: {lowercse: true}}
            - {name: rewards.py:two_args}
            - {name: rewards.py:score}
    """)
    )
    r = subprocess.run(
        [sys.executable, "-m", "services.cli", "config", "validate", "c.yaml"],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 2, r.stderr
    lines = [line.strip() for line in r.stderr.splitlines()[1:]]
    assert [line.split(":")[0] for line in lines] == [
        "gama",
        "data.train",
        "reward.rules[0].name",
        "reward.rules[1].name",
        "reward.rules[2].kwargs",
        "reward.rules[3].kwargs",
        "reward.rules[4].kwargs",
    ], r.stderr
    assert "did you mean 'gamma'? (gamma: Input should be less than or equal to 1" in lines[0]
    assert "unknown answer mode 'flexibel'" in lines[4] and "lowercse" in lines[5]
    assert "cannot be called as fn(prompt, response, label, metadata, **kwargs)" in lines[6]
    # $RLHF_CONFIG is the file when none is given
    r = subprocess.run(
        [sys.executable, "-m", "services.cli", "config", "validate"],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT), "RLHF_CONFIG": "c.yaml"},
    )
    assert r.returncode == 2 and "reward.rules[0].name" in r.stderr


def test_train_local_with_a_function_by_path_and_one_that_raises(user_dir, tiny_model_dir):
    rows = [
        {"prompt": f"{w}=", "label": w[::-1]}
        for w in (
            "abc",
            "bca",
            "cab",
            "aab",
            "bba",
            "abb",
            "bab",
            "aba",
            "ccb",
            "cbc",
            "bcc",
            "acc",
            "cac",
            "cca",
            "bcb",
            "cbb",
        )
    ]
    (user_dir / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = [
        sys.executable,
        "-m",
        "services.cli",
        "train",
        "--local",
        "-c",
        str(ROOT / "configs" / "tiny-cpu.yaml"),
        "--set",
        f"model.path={tiny_model_dir}",
        "--set",
        "data.train=p.jsonl",
        "--set",
        "data.eval=null",
        "--set",
        "data.eval_size=2",
        "--set",
        "run.iterations=1",
        "--set",
        "rollout_batch_size=4",
        "--set",
        "ppo_mini_batch_size=4",
    ]
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}
    ok = subprocess.run(
        base + ["--run-dir", "ok", "--set", "reward.rules=[{name: rewards.py:score}]"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "data.eval is not set: 2 of the 16 prompts of p.jsonl are held out" in ok.stderr
    bad = subprocess.run(
        base + ["--run-dir", "bad", "--set", "reward.rules=[{name: rewards.py:boom}]"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert bad.returncode == 1
    assert "error: the run stopped: reward function 'rewards.py:boom' raised ZeroDivisionError" in bad.stderr
    assert "return a / b" in bad.stderr  # the user's traceback, as it is


def test_up_with_a_function_by_path_and_one_that_raises(user_dir, tiny_model_dir):
    """Under `rlhf up` the reward service imports the file from the directory `up` ran in; a
    function that raises stops the run (the worker exits, `up` stops everything), with its
    traceback in the output, instead of dead-lettering prompts one by one."""
    import os

    base = [
        sys.executable,
        "-m",
        "services.cli",
        "up",
        "-c",
        str(ROOT / "configs" / "tiny-cpu.yaml"),
        "--set",
        f"model.path={tiny_model_dir}",
        "--set",
        "run.iterations=1",
        "--set",
        "rollout_batch_size=4",
        "--set",
        "ppo_mini_batch_size=4",
        "--set",
        "data.eval_size=4",
        "--set",
        "run.eval_interval=0",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ok = subprocess.run(
        base + ["--run-dir", "ok", "--set", "reward.rules=[{name: rewards.py:score}]"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert ok.returncode == 0, (ok.stdout[-3000:], ok.stderr[-3000:])
    bad = subprocess.run(
        base + ["--run-dir", "bad", "--set", "reward.rules=[{name: rewards.py:boom}]"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    out = bad.stdout + bad.stderr
    assert bad.returncode == 3, out[-3000:]
    assert "rollout-0 stopped the run" in out or "stopped the run" in out
    assert "reward function 'rewards.py:boom' raised ZeroDivisionError" in out and "return a / b" in out
    assert (
        not (user_dir / "bad" / "metrics.jsonl").exists()
        or "ppo/pg_loss" not in (user_dir / "bad" / "metrics.jsonl").read_text()
    )  # nothing was trained on
