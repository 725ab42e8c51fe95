"""tests/reap.py, what `make test` runs its suites under: a stopped test run leaves no process
behind, neither the command's children nor the orphans it made in sessions of their own (as
`rlhf up` starts its services and Redis), whether the reaper is signalled itself or its parent
(`make`) is killed."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REAP = Path(__file__).resolve().parent / "reap.py"

# a child that starts a grandchild in a session of its own and exits: the grandchild is an orphan
# (re-parented to the reaper); a second child stays; each pid is written to `pids`, one a line
SPAWN = textwrap.dedent(
    """
    import os, subprocess, sys, time
    pids = sys.argv[1]
    orphan_maker = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys; p = subprocess.Popen(['sleep', '600'], start_new_session=True); "
        f"open({pids!r}, 'a').write(f'{{p.pid}}\\\\n')")])
    orphan_maker.wait()
    stays = subprocess.Popen(["sleep", "600"])
    open(pids, "a").write(f"{stays.pid}\\n{os.getpid()}\\n")
    time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill(pids: list[int]) -> None:
    """What a failed test would leave behind."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def _started(pids: Path) -> list[int]:
    assert _wait(lambda: pids.exists() and len(pids.read_text().split()) == 3), "the processes did not start"
    return [int(p) for p in pids.read_text().split()]


def test_a_sigterm_stops_every_descendant_orphans_included(tmp_path):
    pids = tmp_path / "pids"
    env = {**os.environ, "RLHF_REAP_GRACE_S": "5"}
    err = tmp_path / "stderr"  # a file, not a pipe: a process left behind would hold a pipe open
    with err.open("w") as f:
        reaper = subprocess.Popen(
            [sys.executable, str(REAP), sys.executable, "-c", SPAWN, str(pids)], env=env, stderr=f
        )
    started = _started(pids)
    try:
        assert all(_alive(p) for p in started)
        reaper.send_signal(signal.SIGTERM)
        assert reaper.wait(timeout=60) == 128 + signal.SIGTERM
        assert "SIGTERM: stopped every process" in err.read_text()
        assert _wait(lambda: not any(_alive(p) for p in started)), [p for p in started if _alive(p)]
    finally:
        _kill(started)


def test_a_parent_killed_outright_takes_the_reaper_and_everything_with_it(tmp_path):
    """`make` killed (SIGKILL here; make passes no SIGTERM on either): the reaper gets its death
    signal and stops the rest."""
    pids = tmp_path / "pids"
    env = {**os.environ, "RLHF_REAP_GRACE_S": "5"}
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys; subprocess.run(sys.argv[1:])", sys.executable, str(REAP)]
        + [sys.executable, "-c", SPAWN, str(pids)],
        env=env,
    )
    started = _started(pids)
    try:
        parent.kill()
        parent.wait()
        assert _wait(lambda: not any(_alive(p) for p in started)), [p for p in started if _alive(p)]
    finally:
        _kill(started)


def test_a_command_that_ends_leaving_processes_is_told_and_cleaned(tmp_path):
    pids = tmp_path / "pids"
    leaky = (
        "import subprocess, sys; p = subprocess.Popen(['sleep', '600'], start_new_session=True); "
        f"open({str(pids)!r}, 'w').write(str(p.pid)); sys.exit(3)"
    )
    err = tmp_path / "stderr"
    with err.open("w") as f:
        done = subprocess.run(
            [sys.executable, str(REAP), sys.executable, "-c", leaky],
            env={**os.environ, "RLHF_REAP_GRACE_S": "5"},
            stderr=f,
            timeout=60,
        )
    left = int(pids.read_text())
    try:
        assert done.returncode == 3  # the command's own exit code
        assert "left 1 process(es) running; stopping them" in err.read_text() and "sleep 600" in err.read_text()
        assert not _alive(left)
    finally:
        _kill([left])


def test_a_command_killed_by_a_signal_exits_as_a_shell_says_it():
    done = subprocess.run(
        [sys.executable, str(REAP), sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
        timeout=60,
    )
    assert done.returncode == 128 + signal.SIGKILL


def test_the_daemons_named_to_keep_are_left_running(tmp_path):
    """dockerd and containerd (the Docker suite's, started on purpose) by default; here `sleep`."""
    pids = tmp_path / "pids"
    leaky = (
        "import subprocess; p = subprocess.Popen(['sleep', '600'], start_new_session=True); "
        f"open({str(pids)!r}, 'w').write(str(p.pid))"
    )
    env = {**os.environ, "RLHF_REAP_GRACE_S": "5", "RLHF_REAP_KEEP": "dockerd,sle"}  # names by their beginning
    done = subprocess.run([sys.executable, str(REAP), sys.executable, "-c", leaky], env=env, timeout=60)
    kept = int(pids.read_text())
    try:
        assert done.returncode == 0 and _alive(kept)
    finally:
        _kill([kept])


def test_a_reader_of_stderr_gone_first_does_not_stop_the_cleanup(tmp_path):
    """Ctrl-C in a terminal kills `tee` (the suite's log) with the reaper: stopping comes first, and
    saying so into a closed pipe fails quietly."""
    pids = tmp_path / "pids"
    env = {**os.environ, "RLHF_REAP_GRACE_S": "5"}
    reaper = subprocess.Popen(
        [sys.executable, str(REAP), sys.executable, "-c", SPAWN, str(pids)], env=env, stderr=subprocess.PIPE
    )
    started = _started(pids)
    try:
        assert reaper.stderr is not None
        reaper.stderr.close()  # the reader is gone
        reaper.send_signal(signal.SIGTERM)
        assert reaper.wait(timeout=60) == 128 + signal.SIGTERM
        assert _wait(lambda: not any(_alive(p) for p in started)), [p for p in started if _alive(p)]
    finally:
        _kill(started)
