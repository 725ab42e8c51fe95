"""The whole system on the CPU with the tiny model, each service its own process (`rlhf up`),
while things go wrong on purpose:

- a rollout worker claims prompts, hangs, and is killed with SIGKILL: its prompts are reclaimed;
- a second generation server starts mid-run: it pulls the current weights and gets every push;
- the learner is killed with SIGKILL mid-run: `rlhf up` restarts it and it resumes from its
  checkpoint.

The run must still complete, every prompt of every epoch must be trained on exactly once (the
learner's ledger of checkpointed prompt ids), and weight versions must advance on every
generation server.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import yaml

from services.common.config import load_config
from services.generation.client import GenerationClient
from tests.e2e.support import run_iterations, up_command, write_train_data

ITERATIONS, BATCH, PROMPTS = 80, 8, 48
NS = "e2e"


def _wait(pred, timeout_s, what, proc=None, log=None):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.1)
    tail = Path(log).read_text()[-3000:] if log and Path(log).exists() else ""
    raise AssertionError(f"timed out waiting for {what}\n{tail}")


class _Process:
    """A subprocess whose output is drained into `lines` by a thread; ready once it prints a line
    starting with `ready_prefix` (its fields, key=value, in `ready`)."""

    def __init__(self, cmd, ready_prefix, env=None):
        import threading

        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})}
        )
        self.prefix = ready_prefix
        self.lines: list[str] = []
        self.ready: dict = {}
        self._ready = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith(self.prefix) and not self._ready.is_set():
                self.ready = dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)
                self.ready["line"] = line.strip()
                self._ready.set()

    def wait_ready(self, timeout_s=600) -> dict:
        if not self._ready.wait(timeout_s):
            raise AssertionError(f"no {self.prefix} line:\n" + "".join(self.lines[-30:]))
        return self.ready

    def stop(self):
        """SIGTERM, then SIGKILL if it has not exited in a generous while: how fast a server shuts
        down (rpc.grace_s and its own teardown, slower on a busy machine) is not what this checks."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _serve(kind, config, url, *extra, env=None) -> _Process:
    """`rlhf serve KIND`, ready at its LISTENING line."""
    return _Process(
        [sys.executable, "-m", "services.cli", "serve", kind, "-c", str(config), "--set", f"replay.url={url}", *extra],
        "LISTENING ",
        env,
    )


@pytest.fixture(scope="module")
def scenario(tiny_model_dir, redis_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    run_dir = root / "run"
    data = root / "train.jsonl"
    records = write_train_data(data, PROMPTS, seed=0)
    config = root / "e2e.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "rollout_batch_size": BATCH,
                "prompt_length": 16,
                "response_length": 8,
                "adv_estimator": "gae",
                "ppo_epochs": 1,
                "ppo_mini_batch_size": 8,
                "actor_lr": 2e-4,
                "model": {"path": tiny_model_dir, "device": "cpu"},
                "critic": {"lr": 1e-3},
                "data": {"train": str(data), "eval": "synthetic:reverse", "eval_size": 16},
                "run": {"iterations": ITERATIONS, "eval_interval": 0, "checkpoint_interval": 2, "seed": 0},
                "replay": {
                    "namespace": NS,
                    "claim_idle_s": 2.0,
                    "heartbeat_s": 0.5,
                    "heartbeat_ttl_s": 3.0,
                    "block_ms": 200,
                },
                "rollout": {"prompts_per_request": 4, "concurrency": 2},
            }
        )
    )
    url = redis_server.url
    out = {"run_dir": run_dir, "config": config, "records": records}
    up_log = root / "up.log"
    with up_log.open("w") as log:
        up = subprocess.Popen(
            up_command(config, run_dir, "--workers", "1", "--set", f"replay.url={url}"),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    # services started by hand need the secrets `rlhf up` generated (the auth token)
    _wait(lambda: (run_dir / "secrets.env").exists(), 300, "secrets.env", up, up_log)
    secrets = dict(line.split("=", 1) for line in (run_dir / "secrets.env").read_text().splitlines())
    # a worker that claims prompts and hangs with them (tests/e2e/stalled_worker.py), started
    # alongside the system; it says HOLDING once it holds prompts (the event itself, not a poll of
    # Redis keys that may exist before their consumer group)
    doomed = _Process(
        [sys.executable, "-m", "tests.e2e.stalled_worker", str(config), url, "doomed"], "HOLDING ", env=secrets
    )
    late = None
    try:
        # (its claim is not checked in Redis here: after claim_idle_s a live worker may already
        # have reclaimed it, which is the behaviour under test)
        out["doomed_held"] = int(doomed.wait_ready(timeout_s=600)["line"].split()[1])
        doomed.proc.send_signal(signal.SIGKILL)
        doomed.proc.wait()
        # a generation server that joins mid-run
        _wait(lambda: run_iterations(run_dir) >= 3, 600, "iteration 3", up, up_log)
        status = json.loads((run_dir / "services.json").read_text())
        learner_http = status["services"]["learner"]["http_port"]
        import urllib.request

        status_request = urllib.request.Request(
            f"http://127.0.0.1:{learner_http}/status", headers={"Authorization": f"Bearer {secrets['RLHF_AUTH_TOKEN']}"}
        )
        before = json.load(urllib.request.urlopen(status_request, timeout=10))
        late = _serve("generation", config, url, "--port", "0", "--metrics-port", "-1", env=secrets)
        port = late.wait_ready()["port"]
        rpc = load_config(config).rpc
        rpc.auth_token = secrets["RLHF_AUTH_TOKEN"]
        client = GenerationClient(f"127.0.0.1:{port}", rpc)
        out["late_version_at_start"] = client.policy_version
        out["learner_version_before_late"] = before["policy_version"]
        # the learner dies mid-run; `rlhf up` restarts it and it resumes from its checkpoint
        it_before = run_iterations(run_dir)
        out["learner_killed_after"] = it_before
        learner_pid = json.loads((run_dir / "services.json").read_text())["services"]["learner"]["pid"]
        os.kill(learner_pid, signal.SIGKILL)
        assert up.wait(timeout=1800) == 0, up_log.read_text()[-4000:]  # a deadline for a hang
        # the final push (or, had it failed, the server's own catch-up pull) reaches it
        final = json.loads((run_dir / "summary.json").read_text())["policy_version"]

        def late_at_final() -> bool:
            try:
                return client.policy_version == final
            except grpc.RpcError as e:  # say why, with what the server printed
                raise AssertionError(
                    f"the late server did not answer ({e.code().name}: {e.details()}); its "
                    f"output:\n{''.join(late.lines[-40:])}"
                ) from None

        _wait(late_at_final, 600, "the late server at the final version")
        out["late_version_at_end"] = client.policy_version
        client.close()
    finally:
        for p in (doomed, late):
            if p is not None:
                p.stop()
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            up.wait(timeout=120)
    out["up_log"] = up_log.read_text()
    out["late_log"] = "".join(late.lines) if late else ""
    out["summary"] = json.loads((run_dir / "summary.json").read_text())
    out["ledger"] = [json.loads(x) for x in (run_dir / "trained.jsonl").read_text().splitlines()]
    return out


def test_run_completes_after_worker_and_learner_crashes(scenario):
    s = scenario["summary"]
    assert s["iterations"] == ITERATIONS
    assert scenario["doomed_held"] > 0
    assert s["resumed_from"] is not None and s["resumed_from"] >= 2, scenario["up_log"][-2000:]
    assert "learner exited with code -9; restarting it" in scenario["up_log"]


def test_every_prompt_of_an_epoch_is_trained_exactly_once(scenario):
    uids = [u for row in scenario["ledger"] for u in row["uids"]]
    assert len(uids) == ITERATIONS * BATCH
    assert len(set(uids)) == len(uids), "a prompt was trained on twice"
    ids = {r.id for r in scenario["records"]}
    by_epoch: dict[int, set] = {}
    for u in uids:
        epoch, rid = u.split(":", 1)
        by_epoch.setdefault(int(epoch), set()).add(rid)
    full_epochs = ITERATIONS * BATCH // PROMPTS
    for e in range(full_epochs):
        assert by_epoch[e] == ids, f"epoch {e}: missing {sorted(ids - by_epoch[e])[:5]}"


def test_weight_versions_advance_on_every_generation_server(scenario):
    final = scenario["summary"]["policy_version"]
    assert final >= ITERATIONS
    # the late server pulled the then-current policy when it started, and got every push after it
    assert scenario["late_version_at_start"] >= scenario["learner_version_before_late"] > 0
    assert "pulled policy version" in scenario["late_log"], scenario["late_log"][-2000:]
    assert scenario["late_version_at_end"] == final
    log = (scenario["run_dir"] / "logs" / "generation-0.log").read_text()
    applied = [int(v) for v in re.findall(r"policy version (\d+) applied", log)]
    assert applied == sorted(applied) and applied[-1] == final
    assert len(applied) >= ITERATIONS
