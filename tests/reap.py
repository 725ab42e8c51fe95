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
  RLHF_REAP_KEEP, names of executables, comma-separated (default: dockerd, which
  docker/ci-setup.sh starts for the Docker suite).

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
KEEP = {name for name in os.environ.get("RLHF_REAP_KEEP", "dockerd").split(",") if name}


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
        if fields[0] != "Z" and comm not in KEEP:  # a zombie is dead already: its parent (here) reaps it
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
        except ProcessLookupError:
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
    while descendants(me):
        reap_zombies()
        time.sleep(0.05)
    return left


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    stopped: list[int] = []
    signal.signal(signal.SIGTERM, lambda sig, _: stopped.append(sig))
    signal.signal(signal.SIGINT, lambda sig, _: stopped.append(sig))
    signal.signal(signal.SIGHUP, lambda sig, _: stopped.append(sig))
    if os.getppid() == 1:  # the parent died before the death signal was asked for
        return 128 + signal.SIGTERM
    command = subprocess.Popen(argv)
    while command.poll() is None and not stopped:
        time.sleep(0.2)
    if stopped:
        print(f"reap: {signal.Signals(stopped[0]).name}: stopping every process of `{' '.join(argv)}`", file=sys.stderr)
        killed = stop_descendants(GRACE_S)
        if killed:
            print(f"reap: {len(killed)} process(es) needed SIGKILL after {GRACE_S:.0f} s", file=sys.stderr)
        return 128 + stopped[0]
    left = descendants(os.getpid())
    if left:
        print(f"reap: `{' '.join(argv)}` left {len(left)} process(es) running; stopping them:", file=sys.stderr)
        for pid in left:
            print(f"reap:   {describe(pid)}", file=sys.stderr)
        stop_descendants(GRACE_S)
    return command.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
