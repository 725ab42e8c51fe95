"""A new user's first-day trips, each answered by one sentence that says what to do (issue 41):
a preset's run directory, a run directory of another mode or config, answers stored under another
key, what `config validate` checks, Ctrl-C, a reward API that is down, a `--set` typo, the help,
and the progress bars of a short run."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from services.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
SMALL = "rollout_batch_size: 8\nppo_mini_batch_size: 8\ndata: {eval_size: 4}\n"


def _rlhf(capsys, *args) -> tuple[int, str, str]:
    """`rlhf ARGS` in this process: (exit code, stdout, stderr)."""
    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def _cli(cwd, *args, timeout=300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "services.cli", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _mine(tmp_path, model, extra: str = "") -> Path:
    """mine.yaml on the tiny preset: a few small iterations."""
    path = tmp_path / "mine.yaml"
    path.write_text(f"base: tiny-cpu\nmodel: {{path: {model}}}\n{SMALL}{extra}")
    return path


def _fake_model(tmp_path) -> Path:
    """A directory `config validate` takes for a model (it loads nothing)."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    return model


@pytest.fixture(scope="module")
def local_run(untrained_model_dir, tmp_path_factory):
    """`rlhf train --local` for 3 iterations on the tiny model, a checkpoint and an eval each."""
    root = tmp_path_factory.mktemp("first-day")
    _mine(root, untrained_model_dir, "run: {iterations: 3, eval_interval: 1, checkpoint_interval: 1}\n")
    r = _cli(root, "train", "--local", "-c", "mine.yaml")
    assert r.returncode == 0, r.stderr[-3000:]
    return root, r


# 1. run directories: a preset's is not inherited; eval --run-dir; another mode's or config's refused
def test_a_config_on_a_preset_gets_a_run_directory_of_its_own(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _mine(tmp_path, _fake_model(tmp_path))
    code, out, err = _rlhf(capsys, "config", "validate", "mine.yaml")
    assert code == 0, err
    assert yaml.safe_load(out)["run"]["run_dir"] == "runs/mine"  # not the preset's runs/tiny-cpu
    (tmp_path / "own.yaml").write_text("base: tiny-cpu\nrun: {run_dir: runs/elsewhere}\n")
    assert yaml.safe_load(_rlhf(capsys, "config", "validate", "own.yaml")[1])["run"]["run_dir"] == "runs/elsewhere"


def test_eval_writes_into_the_run_directory_it_is_given(untrained_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _mine(tmp_path, untrained_model_dir)
    code, out, err = _rlhf(capsys, "eval", "-c", "mine.yaml", "--run-dir", "runs/chosen", "--limit", "2")
    assert code == 0, err
    assert (tmp_path / "runs" / "chosen" / "eval" / "summary.json").is_file()
    assert "summary: runs/chosen/eval/summary.json" in out


def test_up_refuses_a_run_directory_of_train_local(local_run):
    root, _ = local_run
    r = _cli(root, "up", "-c", "mine.yaml", "--set", "run.iterations=5", timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr == (
        "error: runs/mine holds a run of `rlhf train --local` (checkpoints/iter_000003), which `rlhf up` "
        "cannot go on from; give this run a directory of its own (--run-dir DIR)\n"
    )


def test_a_reference_of_another_tokenizer_is_refused_before_the_run(untrained_model_dir, tmp_path, capsys, monkeypatch):
    """docs/resume.md's branch block gave a reference of another vocabulary (66 against 49,152
    tokens) and every iteration showed a KL of ~10 (issue 54): the reference, the critic and a
    critic's reward model read the policy's tokens, so a tokenizer that differs is refused."""
    import shutil

    from services.common.model_files import load_tokenizer

    monkeypatch.chdir(tmp_path)
    other = tmp_path / "other"
    shutil.copytree(untrained_model_dir, other)
    tok = load_tokenizer(other)
    tok.add_tokens(["<another>"])
    tok.save_pretrained(other)
    tiny = str(ROOT / "configs" / "tiny-cpu.yaml")
    base = ["--set", f"model.path={untrained_model_dir}"]
    code, _, err = _rlhf(capsys, "config", "validate", tiny, *base, "--set", f"model.reference_path={other}")
    assert code == 2 and f"model.reference_path: {other}'s tokenizer has {len(tok):,} tokens" in err, err
    assert "it must share model.path's tokenizer" in err
    code, _, err = _rlhf(capsys, "config", "validate", tiny, *base, "--set", f"critic.model_path={other}")
    assert code == 2 and "critic.model_path:" in err
    same = ["--set", f"model.reference_path={untrained_model_dir}"]
    assert _rlhf(capsys, "config", "validate", tiny, *base, *same)[0] == 0


def test_a_checkpoint_that_is_not_there_names_the_ones_that_are(local_run):
    """docs/resume.md's `run.resume_from=.../iter_000002` followed in order, when only the newest two
    are kept: it said "learner.pt missing" for a directory that does not exist; now it says so and
    lists the complete checkpoints to choose from (issue 54)."""
    root, _ = local_run
    gone = "runs/mine/checkpoints/iter_000001"
    r = _cli(root, "train", "--local", "-c", "mine.yaml", "--set", f"run.resume_from={gone}", timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"no such checkpoint {gone}; the complete checkpoints of runs/mine are: " in r.stderr
    assert "runs/mine/checkpoints/iter_000003" in r.stderr and "Traceback" not in r.stderr


def test_eval_checks_every_model_before_it_evaluates_any(untrained_model_dir, tmp_path, capsys, monkeypatch):
    """`rlhf eval --baseline B --model M` evaluated the whole baseline before finding M missing, and
    left an empty eval directory; now it checks both first and writes nothing (issue 54)."""
    monkeypatch.chdir(tmp_path)
    tiny = str(ROOT / "configs" / "tiny-cpu.yaml")
    args = ["--set", f"model.path={untrained_model_dir}", "--baseline", str(untrained_model_dir)]
    code, _, err = _rlhf(capsys, "eval", "-c", tiny, *args, "--model", "runs/nope/final", "--out", "ev")
    assert code == 2 and "--model runs/nope/final: no such model directory or checkpoint" in err
    assert not (tmp_path / "ev").exists() and "Traceback" not in err


def test_train_local_refuses_a_run_directory_of_up_or_of_another_config(tmp_path, capsys, monkeypatch):
    """The checkpoint of `rlhf up` is its learner.pt alone (the policy is not beside it); the run's
    config is the config.yaml it saved."""
    monkeypatch.chdir(tmp_path)
    _mine(tmp_path, _fake_model(tmp_path))
    up_checkpoint = tmp_path / "runs" / "mine" / "checkpoints" / "iter_000002"
    up_checkpoint.mkdir(parents=True)
    (up_checkpoint / "learner.pt").write_bytes(b"")
    code, _, err = _rlhf(capsys, "train", "--local", "-c", "mine.yaml")
    assert code == 2
    assert err == (
        "error: runs/mine holds a run of `rlhf up` (checkpoints/iter_000002), which `rlhf train --local` "
        "cannot go on from; give this run a directory of its own (--run-dir DIR)\n"
    )
    other = tmp_path / "runs" / "other"
    other.mkdir()
    (other / "config.yaml").write_text("model: {path: runs/smollm2-135m}\nadv_estimator: grpo\n")
    code, _, err = _rlhf(capsys, "train", "--local", "-c", "mine.yaml", "--run-dir", "runs/other")
    assert code == 2
    assert err == (
        f"error: runs/other holds a run of another config (model.path: runs/smollm2-135m there, "
        f"{tmp_path / 'model'} here; adv_estimator: grpo there, gae here); give this run a directory of its own "
        "(--run-dir DIR), or set those keys back to go on with that run\n"
    )


def test_resume_from_a_checkpoint_of_up_is_refused(tmp_path):
    from services.common.config import config_from_dict
    from services.local import resume_point

    (tmp_path / "learner.pt").write_bytes(b"")
    cfg = config_from_dict({"run": {"resume_from": str(tmp_path)}})
    with pytest.raises(ValueError, match="is a checkpoint of `rlhf up`, which `rlhf train --local` cannot go on"):
        resume_point(cfg, tmp_path / "run")


# 2. answers stored under another key
def test_answers_under_another_key_are_named_when_the_reward_reads_labels(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text('{"prompt": "abc=", "answer": "cba"}\n{"prompt": "abd=", "answer": "dba"}\n')
    (tmp_path / "fn.py").write_text("def score(prompt, response, label, metadata):\n    return 0.0\n")
    (tmp_path / "lab.yaml").write_text(
        f"model: {{path: {_fake_model(tmp_path)}}}\ndata: {{train: p.jsonl, eval: p.jsonl}}\n"
        "reward: {rules: [{name: fn.py:score}]}\n"
    )
    said = "no record of p.jsonl has `label`; keys found: prompt, answer; set data.label_key=answer"
    code, _, err = _rlhf(capsys, "config", "validate", "lab.yaml")
    assert code == 2
    assert err == f"config errors in lab.yaml:\n  data.train: {said}\n  data.eval: {said}\n"
    assert _rlhf(capsys, "config", "validate", "lab.yaml", "--set", "data.label_key=answer")[0] == 0
    # a reward that reads no label (the length rule) takes prompts without one
    assert _rlhf(capsys, "config", "validate", "lab.yaml", "--set", "reward.rules=[{name: length}]")[0] == 0
    # where the data loads (any source: a dataset directory too), told which rule reads labels
    from services.common.config import load_config
    from services.reward.labels import label_reader
    from services.training.data import config_prompts

    cfg = load_config(tmp_path / "lab.yaml", ["reward.rules=[{name: exact_match}]"])
    assert label_reader(cfg) == "reward.rules[0] (exact_match)"
    with pytest.raises(ValueError) as e:
        config_prompts(cfg, "train", lambda text: {"input_ids": text.split()}, label_reader(cfg))
    assert str(e.value) == f"data.train: {said}"


# 3. what `config validate` checks
def test_validate_checks_the_model_every_data_line_and_the_reward_model_pairs(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken.jsonl").write_text('{"prompt": "ab=", "label": "ba"}\n{"prompt": "ba=", "label": \n')
    (tmp_path / "pairs.jsonl").write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\nnot json\n')
    (tmp_path / "v.yaml").write_text(
        f"model: {{path: {tmp_path / 'nomodel'}}}\ndata: {{train: broken.jsonl}}\n"
        "reward_model: {train: pairs.jsonl, eval: missing-pairs.jsonl}\n"
    )
    code, _, err = _rlhf(capsys, "config", "validate", "v.yaml")
    assert code == 2
    assert err.splitlines() == [
        "config errors in v.yaml:",
        f"  model.path: no model at {tmp_path / 'nomodel'} (config.json missing: the directory does not exist); "
        f"build one with `rlhf init-model --out {tmp_path / 'nomodel'}` (the tiny default) or `rlhf init-model "
        f"--from-gguf smollm2 --out {tmp_path / 'nomodel'}` (SmolLM2-135M-Instruct, as `make smollm2` does), or "
        "set model.path to a model directory or a hub id (org/name)",
        "  data.train: broken.jsonl:2: not JSON: Expecting value at column 27",
        "  reward_model.train: pairs.jsonl:2: not JSON: Expecting value at column 1",
        f"  reward_model.eval: no such file missing-pairs.jsonl (relative paths are read from the current "
        f"directory, {tmp_path}); `rlhf make-prefs -c v.yaml --out missing-pairs.jsonl` writes pairs of the "
        "policy's samples",
    ]


def test_validate_notes_a_model_it_cannot_see_from_here(tmp_path, capsys, monkeypatch):
    """The tiny preset's model (built by `rlhf init-model`, a hub id to the loader until then) and a
    container's volume are notes, not errors: a config is often checked away from where it runs."""
    monkeypatch.chdir(tmp_path)
    code, _, err = _rlhf(capsys, "config", "validate", str(ROOT / "configs" / "tiny-cpu.yaml"))
    assert code == 0 and err == (
        "note: model.path: runs/tiny-model is no directory here, so a run downloads it from the Hugging Face "
        "hub; if it is meant as a directory, build one with `rlhf init-model --out runs/tiny-model` (the tiny "
        "default) or `rlhf init-model --from-gguf smollm2 --out runs/tiny-model` (SmolLM2-135M-Instruct, as "
        "`make smollm2` does)\n"
    )
    code, _, err = _rlhf(
        capsys, "config", "validate", str(ROOT / "configs" / "tiny-cpu.yaml"), "--set", "model.path=/runs-x/m"
    )
    assert code == 0
    assert (
        err
        == "note: model.path: /runs-x/m is not on this machine (no /runs-x here); it is checked where the run starts\n"
    )


def test_a_mistyped_model_directory_and_a_context_too_long_are_errors(tmp_path, capsys, monkeypatch):
    """A path that looks local (beside model directories here) and is missing is an error, with the
    one it was likely meant to be (issue 54: `runs/tiny-modle` passed as "will download from the
    hub" and training failed 8 s later); prompt_length + response_length past the positions the
    model takes is an error (64 + 128 ran silently on the 128-position tiny model)."""
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "runs" / "tiny-model"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 128}))
    tiny = str(ROOT / "configs" / "tiny-cpu.yaml")
    code, _, err = _rlhf(capsys, "config", "validate", tiny, "--set", "model.path=runs/tiny-modle")
    assert code == 2 and "no model at runs/tiny-modle" in err and "did you mean runs/tiny-model?" in err
    sets = ["--set", "model.path=runs/tiny-model", "--set", "prompt_length=64", "--set", "response_length=128"]
    code, _, err = _rlhf(capsys, "config", "validate", tiny, *sets)  # a note here: a preset may name another model
    assert code == 0 and "note: prompt_length + response_length = 64 + 128 = 192 tokens, more than the model" in err
    code, _, err = _rlhf(capsys, "train", "--local", "-c", tiny, *sets, "--run-dir", "r")  # a run refuses it
    assert code == 2 and "64 + 128 = 192 tokens, more than the model takes (128 positions" in err
    assert not (tmp_path / "r").exists()
    code, _, err = _rlhf(capsys, "config", "validate", tiny, *sets[:4], "--set", "response_length=64")
    assert code == 0 and "note" not in err, err


def test_the_config_is_given_as_c_everywhere_and_its_absence_is_one_line(
    untrained_model_dir, tmp_path, capsys, monkeypatch
):
    """`rlhf config validate -c FILE` was refused (only the bare file worked) while every other
    command's usage showed `-c` as a must although $RLHF_CONFIG gives it (issue 54, item 18)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RLHF_CONFIG", raising=False)
    (tmp_path / "c.yaml").write_text(f"model: {{path: {untrained_model_dir}}}\n")
    code, out, _ = _rlhf(capsys, "config", "validate", "-c", "c.yaml")
    assert code == 0 and str(untrained_model_dir) in out
    code, _, err = _rlhf(capsys, "config", "validate", "c.yaml", "-c", "other.yaml")
    assert code == 2 and err == "error: two config files given (c.yaml and -c other.yaml): give one\n"
    for command in ("train", "up", "eval", "train-rm", "make-prefs", "export"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "[-c CONFIG]" in capsys.readouterr().out, command
    code, _, err = _rlhf(capsys, "train", "--local")
    assert code == 2 and err == "error: give a config file: -c FILE (or set $RLHF_CONFIG)\n"


def test_a_fresh_checkouts_pipeline_config_says_which_command_makes_each_missing_input(tmp_path, capsys, monkeypatch):
    """configs/smollm2-rlhf.yaml failed `config validate` on a fresh checkout with advice for
    another model (issue 54, item 19): each missing input now names the command that makes it, with
    the config it was given, and a relative path says where it was looked for."""
    from huggingface_hub import constants

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # as here: no hub to download it from
    code, _, err = _rlhf(capsys, "config", "validate", str(ROOT / "configs" / "smollm2-rlhf.yaml"))
    config = ROOT / "configs" / "smollm2-rlhf.yaml"
    assert code == 2
    assert "`rlhf init-model --from-gguf smollm2 --out runs/smollm2-135m` (SmolLM2-135M-Instruct" in err
    assert f"(relative paths are read from the current directory, {tmp_path})" in err
    assert f"`rlhf make-prefs -c {config} --out runs/smollm2-rlhf/pairs.jsonl`" in err
    assert f"`rlhf train-rm -c {config} --out runs/smollm2-rlhf/reward-model` trains one" in err


def test_train_rm_refuses_to_mix_an_ensemble_into_a_folder_of_another_shape(tmp_path, capsys, monkeypatch):
    """An ensemble `train-rm` mixed its members into an existing reward-model folder (issue 54,
    item 19): a folder holding one model, or an ensemble of another size, is refused before any
    training (one model trained into an ensemble's folder replaces it: test_anti_hacking)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pairs.jsonl").write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n')
    (tmp_path / "rm").mkdir()
    (tmp_path / "rm" / "config.json").write_text("{}")
    (tmp_path / "c.yaml").write_text("reward_model: {train: pairs.jsonl, out: rm, ensemble: 3}\n")
    code, _, err = _rlhf(capsys, "train-rm", "-c", "c.yaml")
    assert code == 2
    assert err == (
        "error: rm already holds one reward model; an ensemble of 3 written into it would mix with it: give "
        "another --out, or remove the folder first\n"
    )
    (tmp_path / "ens").mkdir()
    (tmp_path / "ens" / "ensemble.json").write_text('{"members": ["member-0", "member-1"]}')
    code, _, err = _rlhf(capsys, "train-rm", "-c", "c.yaml", "--out", "ens")
    assert code == 2 and "ens already holds an ensemble of 2; an ensemble of 3 written into it" in err


# 4. Ctrl-C
def test_ctrl_c_checkpoints_and_says_how_to_resume(untrained_model_dir, tmp_path):
    _mine(tmp_path, untrained_model_dir)
    cmd = ["train", "--local", "-c", "mine.yaml", "--set", "run.iterations=40", "--set", "run.checkpoint_interval=0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen(
        [sys.executable, "-m", "services.cli", *cmd],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    watchdog = threading.Timer(300, p.kill)
    watchdog.start()
    try:
        assert p.stdout is not None
        for line in p.stdout:  # the first iteration's line, then Ctrl-C
            if line.startswith("iter    1/"):
                p.send_signal(signal.SIGINT)
                break
        out, err = p.communicate()
    finally:
        watchdog.cancel()
    assert p.returncode == 130, err[-3000:]
    last = err.strip().splitlines()[-1]
    n = int(last.split("interrupted at iteration ", 1)[1].split(":", 1)[0])
    checkpoint = f"runs/mine/checkpoints/iter_{n:06d}"
    assert last == f"interrupted at iteration {n}: checkpoint in {checkpoint}; resume with rlhf {' '.join(cmd)}"
    assert "Traceback" not in err and (tmp_path / checkpoint / "learner.pt").is_file()
    again = _cli(tmp_path, *cmd[:-4], "--set", f"run.iterations={n + 1}")
    assert again.returncode == 0 and f"resumed from {checkpoint} (iteration {n})" in again.stderr


# 5. a reward API that is down
@pytest.mark.parametrize(
    "command, target, left",
    [
        ("train-rm", "services.reward_model.train.train_reward_model", "no model"),
        ("eval", "services.cli.eval_model.run_eval", "--out directory"),
        ("make-prefs", "services.reward_model.rlaif.make_preferences", "no pairs were written"),
    ],
)
def test_ctrl_c_in_the_offline_commands_is_one_line(
    command, target, left, untrained_model_dir, tmp_path, capsys, monkeypatch
):
    """Ctrl-C on `train-rm`, `eval` and `make-prefs` printed a 34-100 line KeyboardInterrupt
    traceback with exit 1; now one line saying what is left, exit 130 (issue 54)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pairs.jsonl").write_text(json.dumps({"prompt": "a=", "chosen": "a", "rejected": "b"}) + "\n")

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(target, interrupted)
    sets = ["--set", f"model.path={untrained_model_dir}", "--set", "reward_model.train=pairs.jsonl"]
    sets += ["--set", f"reward_model.base={untrained_model_dir}"]
    extra = ["--out", "out.jsonl"] if command == "make-prefs" else []
    code, _, err = _rlhf(capsys, command, "-c", str(ROOT / "configs" / "tiny-cpu.yaml"), *sets, *extra)
    assert code == 130, err
    assert err.startswith(f"stopped (Ctrl-C): `rlhf {command}` was interrupted; ") and left in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


DIES = """
class Dies:
    \"\"\"An environment that serves 14 sessions, then is gone (every reset raises).\"\"\"

    sessions = 0

    def reset(self, sample):
        type(self).sessions += 1
        if type(self).sessions > 14:
            raise RuntimeError("the environment is gone")
        return sample.prompt

    def step(self, reply):
        return "", float(len(reply) > 0), True
"""


def test_an_environment_lost_mid_run_checkpoints_and_stops_with_one_sentence(untrained_model_dir, tmp_path):
    """An environment that dies mid-run ended `train --local` in an uncaught RuntimeError
    traceback with no checkpoint (issue 54); now the run keeps its last iteration's checkpoint
    and stops with one sentence saying why and how to go on, exit 1, as a stop does. A partial
    failure (some prompts' sessions) goes on, as before."""
    (tmp_path / "dies.py").write_text(DIES)
    config = (
        "base: tiny-cpu\n"
        f"model: {{path: {untrained_model_dir}}}\n"
        "adv_estimator: grpo\nnum_return_sequences_in_group: 2\nrollout_batch_size: 4\nppo_mini_batch_size: 8\n"
        "prompt_length: 64\n"
        "rollout: {environment: dies.py:Dies, max_turns: 1}\n"
        "data: {eval_size: 4}\nrun: {iterations: 5, eval_interval: 0, checkpoint_interval: 0}\n"
    )
    (tmp_path / "dies.yaml").write_text(config)
    r = _cli(tmp_path, "train", "--local", "-c", "dies.yaml", timeout=600)
    assert r.returncode == 1, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the run stopped: every prompt of iteration ") and "Traceback" not in r.stderr
    assert "the environment is gone" in last and "; once mended, resume with rlhf train --local -c dies.yaml" in last
    stopped = int(last.split("checkpoint of iteration ")[1].split()[0])
    assert (
        stopped >= 1 and (tmp_path / "runs" / "dies" / "checkpoints" / f"iter_{stopped:06d}" / "learner.pt").is_file()
    )


def test_a_reward_api_that_is_down_is_one_line(untrained_model_dir, tmp_path):
    with socket.socket() as closed:  # bound, never listening: connections to it are refused
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}/score"
        _mine(tmp_path, untrained_model_dir, f"reward: {{type: http, http_url: '{url}', http_retries: 0}}\n")
        r = _cli(tmp_path, "train", "--local", "-c", "mine.yaml")
    assert r.returncode == 1
    assert r.stderr == (
        f"error: the run stopped: reward API failed: {url} gave no reward after 1 attempt (ConnectError: "
        "[Errno 111] Connection refused); check that it is running and reachable at that URL (reward.http_url)\n"
    )


# 6. a --set typo
def test_a_set_typo_names_its_set_not_the_config_file(tmp_path, capsys, monkeypatch):
    tiny = str(ROOT / "configs" / "tiny-cpu.yaml")
    code, _, err = _rlhf(capsys, "config", "validate", tiny, "--set", "rollout_batch_sise=8")
    assert code == 2
    assert err == "config error: --set rollout_batch_sise=8: unknown key; did you mean 'rollout_batch_size'?\n"
    code, _, err = _rlhf(capsys, "config", "validate", tiny, "--set", "gamma=3", "--set", "run.iterations=0")
    assert code == 2 and err == (
        "config errors:\n"
        "  --set gamma=3: Input should be less than or equal to 1 (got 3)\n"
        "  --set run.iterations=0: Input should be greater than or equal to 1 (got 0)\n"
    )
    monkeypatch.setenv("RLHF_SET", "pg_clip=4")
    code, _, err = _rlhf(capsys, "eval", "-c", tiny, "--limit", "-1")
    assert code == 2 and err == (
        "config errors:\n"
        "  $RLHF_SET pg_clip=4: Input should be less than 1 (got 4)\n"
        "  --limit -1: Input should be greater than or equal to 1 (got -1)\n"
    )
    # a section the command line names that does not exist, a --set without "=", a section's own
    # refusal of a key set there: each names its --set, not the file (issue 54)
    monkeypatch.delenv("RLHF_SET")
    code, _, err = _rlhf(capsys, "config", "validate", tiny, "--set", "rn.iterations=3")
    assert code == 2 and err == "config error: --set rn.iterations=3: rn: unknown key; did you mean 'run'?\n"
    code, _, err = _rlhf(capsys, "config", "validate", tiny, "--set", "rollout_batch_size")
    assert code == 2 and err == "config error: --set 'rollout_batch_size': expected key=value\n"
    sets = ["--set", "rollout.partial_tokens=4", "--set", "rollout.agent=x.py:f"]
    code, _, err = _rlhf(capsys, "config", "validate", tiny, *sets)
    assert code == 2 and err.startswith("config error: --set rollout.partial_tokens=4: rollout: partial_tokens=4")
    # the file's own mistakes still name the file
    (tmp_path / "bad.yaml").write_text("gama: 0.9\n")
    code, _, err = _rlhf(capsys, "config", "validate", str(tmp_path / "bad.yaml"))
    assert err == f"config error in {tmp_path / 'bad.yaml'}: gama: unknown key; did you mean 'gamma'?\n"


# 7. the help
def test_every_command_and_option_has_help_and_serve_names_every_service(capsys):
    import argparse

    def missing(parser, name):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                yield from (f"{name} {c.dest}" for c in action._choices_actions if not c.help)
                for sub, p in action.choices.items():
                    yield from missing(p, f"{name} {sub}")
            elif action.help is None:
                yield f"{name} {'/'.join(action.option_strings) or action.dest}"

    parser = build_parser()
    assert list(missing(parser, "rlhf")) == []
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    summary = " ".join(capsys.readouterr().out.split())
    choices = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    services = next(a for a in choices["serve"]._actions if a.dest == "service").choices
    assert f"serve run one service: {', '.join(services[:-1])} or {services[-1]}" in summary
    assert "gateway" in summary


# 8. the progress bars of a short run
def test_a_short_run_shows_its_own_progress_lines_and_no_model_file_bars(local_run):
    root, r = local_run
    assert "Loading weights" not in r.stderr and "Writing model shards" not in r.stderr, r.stderr
    assert [line.split()[1] for line in r.stdout.splitlines() if line.startswith("iter")] == [
        "0/3",
        "1/3",
        "2/3",
        "3/3",
    ]
    assert "done: held-out reward" in r.stdout
    assert json.loads((root / "runs" / "mine" / "summary.json").read_text())["iterations"] == 3


def test_a_long_eval_batch_says_it_is_still_sampling_and_instant_steps_show_no_bars(monkeypatch):
    """`rlhf eval` said nothing between its batches (256 prompts: minutes on a real model), while
    instant steps drew bars ("Map", "Loading weights") (issue 54, item 19)."""
    from services.cli.eval_model import heartbeat
    from services.cli.shared import quiet_model_files

    said: list[str] = []
    seen = threading.Event()

    def say(line: str) -> None:
        said.append(line)
        seen.set()

    with heartbeat(say, lambda: "  model: 0/1000 prompts, sampling the next 256", every_s=0.05):
        assert seen.wait(30)
    assert said[0].startswith("  model: 0/1000 prompts, sampling the next 256 (") and said[0].endswith(" s so far)")
    monkeypatch.delenv("HF_DATASETS_DISABLE_PROGRESS_BARS", raising=False)
    quiet_model_files()
    assert os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] == "1"
