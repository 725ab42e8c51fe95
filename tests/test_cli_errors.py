"""A user's mistake is one `error` line on stderr and exit code 2, never a traceback.

Each case is the CLI's `main` in a process of its own, forked from one interpreter that imported
it (and torch) once: what `python -m services.cli ARGS` runs, at a fraction of the CPU time; one
case also goes through `python -m services.cli` itself."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x10"

# argv: {name: [args]} on stdin; each case's stdout/stderr in OUT/name.out|.err; {name: exit code} on stdout
DRIVER = r"""
import json, os, signal, sys, traceback
from services.cli import main

out, cases = sys.argv[1], json.loads(sys.stdin.read())
codes, running = {}, {}

def reap():
    pid, status = os.waitpid(-1, 0)
    codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)

for name, args in cases.items():
    while len(running) >= 3:
        reap()
    sys.stdout.flush()
    pid = os.fork()
    if pid:
        running[pid] = name
        continue
    for fd, ext in ((1, "out"), (2, "err")):
        os.dup2(os.open(os.path.join(out, name + "." + ext), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    signal.alarm(120)  # a case that starts serving instead of failing dies here
    code = 1
    try:  # what `python -m services.cli` does with main's return, SystemExit and an exception
        code = main(args)
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else (1 if e.code else 0)
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
while running:
    reap()
print(json.dumps(codes))
"""

CASES = [
    "binary_config_validate",
    "binary_config_serve",
    "grpc_port_in_use",
    "metrics_port_in_use",
    "http_port_in_use",
    "grpc_port_too_big",
    "grpc_port_negative",
    "metrics_port_negative",
    "generation_model_missing",
    "critic_model_empty",
    "generation_model_not_a_hub_id",
    "critic_hub_id_offline",
    "train_model_is_a_file",
    "train_run_dir_under_a_file",
    "learner_run_dir_under_a_file",
    "train_data_missing",
    "up_data_missing",
    "learner_data_missing",
]


def _rlhf(args, env, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case's (exit code, stderr, what its one error line must say). Each fails before a
    model would load, so the model is a directory with a config.json and no weights."""
    tmp = tmp_path_factory.mktemp("cli-errors")
    model = tmp / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    binary = tmp / "config.yaml"
    binary.write_bytes(PNG)
    a_file = tmp / "a-file"
    a_file.write_text("not a directory")
    empty = tmp / "empty-model"
    empty.mkdir()
    (tmp / "hub").mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp / "hub")}
    tiny = ["-c", "configs/tiny-cpu.yaml", "--set", f"model.path={model}"]
    free = ["--port", "0", "--metrics-port", "-1"]
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = str(taken.getsockname()[1])
    no_data = ["--set", "data.train=/nonexistent.jsonl"]
    in_use = [f"port {port} on 127.0.0.1 is already in use"]
    cases = {
        "binary_config_validate": (["config", "validate", str(binary)], ["not a text file", str(binary)]),
        "binary_config_serve": (["serve", "reward", "-c", str(binary)], ["not a text file", str(binary)]),
        "grpc_port_in_use": (["serve", "reward", *tiny, "--port", port], ["gRPC", *in_use, "--port"]),
        "metrics_port_in_use": (
            ["serve", "reward", *tiny, "--port", "0", "--metrics-port", port],
            ["metrics", *in_use, "--metrics-port"],
        ),
        "http_port_in_use": (["serve", "reward", *tiny, *free, "--http-port", port], ["HTTP", *in_use, "--http-port"]),
        "grpc_port_too_big": (["serve", "reward", *tiny, "--port", "70000"], ["--port 70000 is out of range: 0-65535"]),
        "grpc_port_negative": (["serve", "reward", *tiny, "--port", "-5"], ["--port -5 is out of range"]),
        "metrics_port_negative": (
            ["serve", "reward", *tiny, "--port", "0", "--metrics-port", "-5"],
            ["--metrics-port -5 is out of range", "-1 turns it off"],
        ),
        "generation_model_missing": (
            ["serve", "generation", *tiny, "--set", f"model.path={tmp / 'none'}", *free],
            ["no model at", "does not exist", f"rlhf init-model --out {tmp / 'none'}"],
        ),
        "critic_model_empty": (
            ["serve", "critic", *tiny, "--set", f"model.path={empty}", *free],
            ["no model at", "the directory is empty", "rlhf init-model --out"],
        ),
        "generation_model_not_a_hub_id": (
            ["serve", "generation", *tiny, "--set", "model.path=not/a/hub-id", *free],
            ["no model at not/a/hub-id", "rlhf init-model --out"],
        ),
        "critic_hub_id_offline": (
            ["serve", "critic", *tiny, "--set", "model.path=acme/no-such-model", *free],
            ["'acme/no-such-model' is neither a local directory nor reachable"],
        ),
        "train_model_is_a_file": (
            ["train", "--local", *tiny, "--set", f"model.path={a_file}", "--run-dir", str(tmp / "run-model")],
            ["no model at", "it is a file", "rlhf init-model"],
        ),
        "train_run_dir_under_a_file": (
            ["train", "--local", *tiny, "--run-dir", str(a_file / "run")],
            ["cannot create the run directory", f"{a_file} is a file"],
        ),
        "learner_run_dir_under_a_file": (
            ["serve", "learner", *tiny, *free, "--http-port", "-1", "--run-dir", str(a_file / "run")],
            ["cannot create the run directory", f"{a_file} is a file"],
        ),
        "train_data_missing": (
            ["train", "--local", *tiny, *no_data, "--run-dir", str(tmp / "run-train")],
            ["data.train: no such file /nonexistent.jsonl"],
        ),
        "up_data_missing": (
            ["up", *tiny, *no_data, "--run-dir", str(tmp / "run-up")],
            ["data.train: no such file /nonexistent.jsonl"],
        ),
        "learner_data_missing": (
            ["serve", "learner", *tiny, *no_data, *free, "--http-port", "-1"],
            ["data.train: no such file /nonexistent.jsonl"],
        ),
    }
    assert sorted(cases) == sorted(CASES)
    out = tmp / "out"
    out.mkdir()
    try:
        p = subprocess.run(
            [sys.executable, "-c", DRIVER, str(out)],
            input=json.dumps({k: a for k, (a, _) in cases.items()}),
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
            env=env,
        )
    finally:
        taken.close()
    assert p.returncode == 0, p.stderr[-3000:]
    codes = json.loads(p.stdout.splitlines()[-1])
    return {name: (codes[name], (out / f"{name}.err").read_text(), needles) for name, (_, needles) in cases.items()}


def _one_error_line(code, stderr, needles):
    assert "Traceback" not in stderr, stderr
    assert code == 2, (code, stderr[-2000:])
    lines = [line for line in stderr.splitlines() if line.startswith(("error: ", "config error"))]
    assert len(lines) == 1, stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.mark.parametrize("case", CASES)
def test_a_user_error_is_one_line_and_exit_2(results, case):
    _one_error_line(*results[case])


def test_the_real_command_too(tmp_path):
    binary = tmp_path / "config.yaml"
    binary.write_bytes(PNG)
    p = _rlhf(["config", "validate", str(binary)], os.environ)
    _one_error_line(p.returncode, p.stderr, ["not a text file", str(binary)])
