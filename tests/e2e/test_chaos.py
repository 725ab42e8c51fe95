"""kill -9 of every kind of service during `rlhf up` (embedded Redis, real processes, the tiny
model on the CPU): each run must complete by itself, and the learner's ledger must show every
prompt of every epoch trained exactly once.

- run "one": one generation server, and on-policy distillation (a teacher server). Killed in turn:
  the generation server, the reward server, the critic server, the teacher server, Redis. Each
  kill stalls the run until the launcher has the service back.
- run "two": two generation servers; the one the held-out eval uses is killed and stays
  registered: the run never pauses (iterations go on before it is back).
- run "no restarts" (--max-restarts 0): the critic dies, the run stops, and the learner's last
  checkpoint cannot be written: one clear message, no traceback.
Also: no secret on any process's command line, the files that hold them are 0600, and a finished
run stays finished.
"""

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.e2e.support import run_iterations, up_command, write_train_data

BATCH, PROMPTS = 8, 40
KILLED = ("generation-0", "reward", "critic", "teacher", "redis")
# run "one" distils too: the frozen initial model, shown the label, teaches beside the reward
DISTILL = {"enabled": True, "hint": "so {label}", "reward_weight": 1.0}
RESTART_DELAY_S = 10.0  # how long the launcher leaves a killed generation server down (run "two"; an
# iteration takes ~0.2 s here, two of them must fit in it)


def _wait(pred, timeout_s, what, up, log):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        if up.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}\n{log.read_text()[-4000:]}")


def _manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "services.json").read_text())


def _start(
    root: Path,
    tiny_model_dir: str,
    iterations: int,
    gen_servers: int,
    max_restarts: int = 2,
    heartbeat_ttl_s: float = 3.0,
    eval_interval: int = 4,
    restart_delay_s: float = 0.0,
    extra: dict | None = None,
):
    run_dir = root / "run"
    data = root / "train.jsonl"
    records = write_train_data(data, PROMPTS, seed=1)
    config = root / "chaos.yaml"
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
                "data": {"train": str(data), "eval": "synthetic:reverse", "eval_size": 8},
                "run": {"iterations": iterations, "eval_interval": eval_interval, "checkpoint_interval": 2, "seed": 0},
                "replay": {
                    "namespace": "chaos",
                    "claim_idle_s": 3.0,
                    "heartbeat_s": 0.5,
                    "heartbeat_ttl_s": heartbeat_ttl_s,
                    "block_ms": 200,
                },
                "rollout": {"prompts_per_request": 4, "concurrency": 2},
                "rpc": {"retry_max_backoff_s": 1.0},
                **(extra or {}),
            }
        )
    )
    log = root / "up.log"
    with log.open("w") as f:
        up = subprocess.Popen(
            up_command(
                config,
                run_dir,
                "--workers",
                "1",
                "--generation-servers",
                str(gen_servers),
                "--max-restarts",
                str(max_restarts),
                "--restart-delay",
                str(restart_delay_s),
            ),
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    return up, run_dir, log, records


def _finish(up, run_dir, log, records) -> dict:
    try:
        code = up.wait(timeout=1800)  # a deadline for a hang: the run takes minutes
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            up.wait(timeout=120)
    return {
        "code": code,
        "log": log.read_text(),
        "run_dir": run_dir,
        "records": records,
        "summary": json.loads((run_dir / "summary.json").read_text()),
        "ledger": [json.loads(x) for x in (run_dir / "trained.jsonl").read_text().splitlines()],
    }


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def _command_lines(run_dir: Path) -> dict[str, str] | None:
    """Every process's command line; None while one of them is being replaced (read again)."""
    m = _manifest(run_dir)
    pids = {name: s["pid"] for name, s in m["services"].items()}
    pids["redis"] = m["redis_pid"]
    try:
        return {
            name: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode() for name, pid in pids.items()
        }
    except FileNotFoundError:
        return None


@pytest.fixture(scope="module")
def one_server(tiny_model_dir, tmp_path_factory):
    iterations = 60
    up, run_dir, log, records = _start(
        tmp_path_factory.mktemp("chaos-one"), tiny_model_dir, iterations, 1, extra={"distill": DISTILL}
    )
    kills = []
    try:
        _wait(lambda: (run_dir / "services.json").exists(), 600, "the system to start", up, log)
        secrets = dict(line.split("=", 1) for line in (run_dir / "secrets.env").read_text().splitlines())
        command_lines = _wait(lambda: _command_lines(run_dir), 120, "every process's command line", up, log)
        for name in KILLED:
            _wait(lambda: (run_dir / "services.json").exists(), 600, "the system to start", up, log)
            it = _wait(
                lambda: run_iterations(run_dir) >= 3 + 4 * len(kills) and run_iterations(run_dir),
                300,
                f"progress before killing {name}",
                up,
                log,
            )
            assert it < iterations - 8, f"the run is too fast for the kills: at {it} of {iterations}"
            m = _manifest(run_dir)
            pid = m["redis_pid"] if name == "redis" else m["services"][name]["pid"]
            _kill(pid)
            kills.append((name, it))
            # back: the launcher restarted it and the learner trained 2 more iterations
            _wait(
                lambda: f"{name} exited with code -9; restarting it" in log.read_text(),
                60,
                f"the launcher to restart {name}",
                up,
                log,
            )
            _wait(lambda: run_iterations(run_dir) >= it + 2, 600, f"iterations after the restart of {name}", up, log)
    except BaseException:
        up.kill()
        raise
    out = _finish(up, run_dir, log, records)
    out["kills"], out["iterations"] = kills, iterations
    out["secrets"], out["command_lines"] = secrets, command_lines
    out["modes"] = {
        f: (run_dir / f).stat().st_mode & 0o777 for f in ("secrets.env", "services.json", "redis/redis.conf")
    }
    # the same command on the finished run: it says so and leaves everything as it is
    summary = (run_dir / "summary.json").read_bytes()
    again = subprocess.run(
        up_command(run_dir.parent / "chaos.yaml", run_dir),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out["again"], out["summary_unchanged"] = again, (run_dir / "summary.json").read_bytes() == summary
    return out


@pytest.fixture(scope="module")
def two_servers(tiny_model_dir, tmp_path_factory):
    iterations = 40
    # the dead server stays in the registry (no heartbeat expiry within the test): workers must
    # step around it, not wait for the registry to forget it. The launcher restarts it only after
    # RESTART_DELAY_S, so it is down for that long whatever the machine's speed
    up, run_dir, log, records = _start(
        tmp_path_factory.mktemp("chaos-two"),
        tiny_model_dir,
        iterations,
        2,
        heartbeat_ttl_s=60.0,
        eval_interval=1,
        restart_delay_s=RESTART_DELAY_S,
    )
    try:
        _wait(lambda: run_iterations(run_dir) >= 3, 600, "iteration 3", up, log)
        services = _manifest(run_dir)["services"]
        # the eval target is the live server whose address sorts first
        victim = min(("generation-0", "generation-1"), key=lambda n: f"127.0.0.1:{services[n]['port']}")
        _kill(services[victim]["pid"])
        # dead, and seen dead by the launcher: from here it is down for RESTART_DELAY_S at least
        _wait(
            lambda: f"{victim} exited with code -9; restarting it in" in log.read_text(),
            60,
            f"the launcher to see {victim} die",
            up,
            log,
        )
        it_dead = run_iterations(run_dir)
        it_on = _wait(
            lambda: run_iterations(run_dir) >= it_dead + 2 and run_iterations(run_dir),
            300,
            f"two iterations with {victim} down",
            up,
            log,
        )
        back_before = f"{victim} is back" in log.read_text()
    except BaseException:
        up.kill()
        raise
    # the run may end before the victim is back (its restart, after the delay, is the one-server
    # run's subject); what matters here is that it never waited for it
    out = _finish(up, run_dir, log, records)
    out.update(iterations=iterations, it_dead=it_dead, it_on=it_on, victim=victim, back_before=back_before)
    return out


@pytest.fixture(scope="module")
def no_restarts(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("chaos-stop")
    up, run_dir, log, _ = _start(root, tiny_model_dir, 500, 1, max_restarts=0)
    try:
        _wait(lambda: run_iterations(run_dir) >= 3, 600, "iteration 3", up, log)
        _kill(_manifest(run_dir)["services"]["critic"]["pid"])
        code = up.wait(timeout=1200)
    finally:
        if up.poll() is None:
            up.kill()
    return {"code": code, "log": log.read_text(), "learner_log": (run_dir / "logs" / "learner.log").read_text()}


def _assert_exactly_once(run: dict) -> None:
    uids = [u for row in run["ledger"] for u in row["uids"]]
    assert len(uids) == run["iterations"] * BATCH
    assert len(set(uids)) == len(uids), "a prompt was trained on twice"
    ids = {r.id for r in run["records"]}
    by_epoch: dict[int, set] = {}
    for u in uids:
        epoch, rid = u.split(":", 1)
        by_epoch.setdefault(int(epoch), set()).add(rid)
    for e in range(run["iterations"] * BATCH // PROMPTS):
        assert by_epoch[e] == ids, f"epoch {e}: missing {sorted(ids - by_epoch[e])[:5]}"


def test_run_with_one_generation_server_survives_each_service_killed(one_server):
    assert one_server["code"] == 0, one_server["log"][-4000:]
    assert one_server["summary"]["iterations"] == one_server["iterations"]
    assert [k for k, _ in one_server["kills"]] == list(KILLED)
    log = one_server["log"]
    for name in KILLED:
        assert f"{name} exited with code -9; restarting it" in log
    _assert_exactly_once(one_server)
    # every iteration trained on the teacher's log-probs, the teacher's restart notwithstanding
    rows = [json.loads(x) for x in (one_server["run_dir"] / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "time/iteration_s" in r]
    assert len(trained) == one_server["iterations"] and all("distill/reverse_kl" in r for r in trained)


def test_restarted_critic_comes_back_from_the_newest_checkpoint(one_server):
    learner_log = (one_server["run_dir"] / "logs" / "learner.log").read_text()
    m = re.search(r"the critic server restarted; it serves (\S+)", learner_log)
    assert m, learner_log[-3000:]
    assert m.group(1).startswith("checkpoints/iter_") and m.group(1).endswith("/critic")


def test_restarted_generation_server_pulls_the_policy_before_serving(one_server):
    gen_log = (one_server["run_dir"] / "logs" / "generation-0.log").read_text()
    assert "pulled policy version" in gen_log, gen_log[-3000:]


def test_losing_one_of_two_generation_servers_never_pauses_the_run(two_servers):
    assert two_servers["code"] == 0, two_servers["log"][-4000:]
    # the run went on while the victim was down: two iterations finished after the launcher saw it
    # dead and before it was back (it is kept down for RESTART_DELAY_S; a run that waited for it
    # would have timed out waiting for those iterations, or seen it back first)
    assert not two_servers["back_before"], {k: two_servers[k] for k in ("it_dead", "it_on")}
    assert two_servers["it_on"] >= two_servers["it_dead"] + 2
    # the eval (every iteration) went on through the other server: the victim missed the pushes
    # while it was down, so the registry shows it behind and it is not an eval target; a target
    # that fails after the push is skipped (tests/learner/test_eval_target.py)
    assert "learner exited" not in two_servers["log"], two_servers["log"][-3000:]
    _assert_exactly_once(two_servers)


def test_no_secret_on_a_command_line_and_their_files_are_private(one_server):
    secrets = one_server["secrets"]
    assert set(secrets) == {"RLHF_AUTH_TOKEN", "RLHF_REDIS_PASSWORD"} and all(len(v) >= 20 for v in secrets.values())
    for name, line in one_server["command_lines"].items():
        for value in secrets.values():
            assert value not in line, f"a secret is on the command line of {name}"
    assert one_server["modes"] == {"secrets.env": 0o600, "services.json": 0o600, "redis/redis.conf": 0o600}
    manifest = (one_server["run_dir"] / "services.json").read_text()
    assert not any(v in manifest for v in secrets.values())


def test_a_finished_run_stays_finished(one_server):
    again = one_server["again"]
    assert again.returncode == 0, again.stdout + again.stderr
    assert "already finished at iteration 60" in again.stdout
    assert one_server["summary_unchanged"]


def test_a_stop_with_the_critic_gone_says_so_in_one_line(no_restarts):
    assert no_restarts["code"] != 0
    assert "critic exited with code -9; stopping the run" in no_restarts["log"]
    learner = no_restarts["learner_log"]
    assert "Traceback" not in learner, learner[-3000:]
    # stopped in the middle of an update or at its checkpoint: either way one line that says what
    # is missing and where a restart resumes
    m = re.search(
        r"ERROR .*stopped without a final checkpoint: .*the critic server at \S+ did not answer "
        r"(Train|Save|Info) .*The newest checkpoint is (iter_\d+|none)",
        learner,
    )
    assert m, learner[-3000:]
