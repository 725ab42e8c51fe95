"""Run a command and leave no process of it behind: what `make test` runs each suite under.

    python3 tests/reap.py COMMAND [ARGS...]

The suites start processes that outlive their parents by design: `rlhf up` starts each service
and its embedded Redis in a session of its own (so that Ctrl-C reaches the launcher alone, which
stops them in order), tests start servers. A run stopped from outside (a CI timeout's SIGTERM to
`make test`, or to its process group) used to leave some running, orphaned: a redis-server, a
`serve critic`. Here:

- this process is a child subreaper (Linux): a descendant whose parent dies is re-parented here,
  not to init, so every process the command started is still found under this one;
- it dies with its parent (the `make` that ran it): a SIGTERM to `make` alone, which make does not
  pass on, still reaches this process;
- on SIGTERM, SIGINT or SIGHUP it sends SIGTERM to every descendant, waits up to
  RLHF_REAP_GRACE_S seconds (default 20) for them to stop, then SIGKILLs what is left;
- when the command ends by itself, descendants still running are named on stderr and stopped
  the same way (a leak the suite should not have);
- the daemons a suite starts for the machine on purpose are left running with what they started:
  RLHF_REAP_KEEP, beginnings of executables' names, comma-separated (default: dockerd and
  containerd, which docker/ci-setup.sh starts for the Docker suite; containerd-shim, which holds
  the containers and is re-parented here when it double-forks, is one of them).

Exits with the command's exit code (128 + the signal when stopped). Standard library only: it
runs before any venv exists.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
GRACE_S = float(os.environ.get("RLHF_REAP_GRACE_S", "20"))
KEEP = tuple(name for name in os.environ.get("RLHF_REAP_KEEP", "dockerd,containerd").split(",") if name)
KILL_WAIT_S = 10.0  # after SIGKILL: a process stuck in the kernel (D state) is reported, not waited for


def prctl(option: int, value: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: nothing to adopt orphans with
        pass


def children_of() -> dict[int, list[int]]:
    """{parent pid: [child pids]} of every process now (from /proc), the KEEP daemons left out
    (and so what they started)."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
        if fields[0] != "Z" and not comm.startswith(KEEP):  # a zombie is dead already: its parent (here) reaps it
            tree.setdefault(int(fields[1]), []).append(int(entry))
    return tree


def descendants(pid: int) -> list[int]:
    tree, found, todo = children_of(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f"{pid} " + f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
    except OSError:
        return str(pid)


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:  # gone already, or not ours to signal (another user's): nothing to do
            pass


def reap_zombies() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def stop_descendants(grace_s: float) -> list[int]:
    """SIGTERM every descendant, SIGKILL those left after `grace_s`; the pids that needed SIGKILL."""
    me = os.getpid()
    signal_all(descendants(me), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while descendants(me) and time.monotonic() < deadline:
        reap_zombies()
        time.sleep(0.2)
    left = descendants(me)
    signal_all(left, signal.SIGKILL)
    deadline = time.monotonic() + KILL_WAIT_S
    while descendants(me) and time.monotonic() < deadline:
        reap_zombies()
        time.sleep(0.05)
    for pid in descendants(me):
        say(f"reap: {describe(pid)} survives SIGKILL (stuck in the kernel?); left as it is")
    return left


def say(line: str) -> None:
    """A line on stderr, which may be a pipe whose reader (tee) a Ctrl-C has killed already."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    parent = os.getppid()
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    stopped: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _: stopped.append(signum))
    if os.getppid() != parent:  # the parent died before the death signal was asked for
        return 128 + signal.SIGTERM
    command = subprocess.Popen(argv)
    while command.poll() is None and not stopped:
        time.sleep(0.2)
    if stopped:  # stop first, then say so: the reader of stderr may be gone with the same signal
        killed = stop_descendants(GRACE_S)
        say(f"reap: {signal.Signals(stopped[0]).name}: stopped every process of `{' '.join(argv)}`")
        if killed:
            say(f"reap: {len(killed)} process(es) needed SIGKILL after {GRACE_S:.0f} s")
        return 128 + stopped[0]
    left = descendants(os.getpid())
    if left:
        say(f"reap: `{' '.join(argv)}` left {len(left)} process(es) running; stopping them:")
        for pid in left:
            say(f"reap:   {describe(pid)}")
        stop_descendants(GRACE_S)
    code = command.returncode
    return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell says it


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
