"""Runs the project's compose files under a real Docker Engine for the compose tests.

Each test gets a compose project of its own (its own containers, network and volumes), an env file
like a user's `.env`, and helpers to read what happened: the learner's /status over the published
port, the run volume's files, the containers' state and Docker's event stream. The tests drive
`docker-compose` (v1, what Debian ships); users run the same files with `docker compose` (v2).
`make test-docker` (docker/ci-setup.sh) installs Docker, starts dockerd and builds the images."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("RLHF_TEST_IMAGE", "rlhf:cpu")
CPU_FILES = ("docker-compose.yml", "docker-compose.cpu.yml")
GPU_FILES = ("docker-compose.yml", "docker-compose.gpu.yml")
TOKEN = "compose-test-token-0123456789"


def compose_binary() -> list[str]:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return ["docker", "compose"]


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return proc


def require_docker() -> None:
    """Fail (not skip) when Docker is not ready: `make test-docker` sets it up, and a compose test
    that silently skipped would hide that the compose file was never run."""
    if shutil.which("docker") is None or docker("info", check=False).returncode != 0:
        pytest.fail("Docker Engine is not running: run `make test-docker` (docker/ci-setup.sh installs and starts it)")
    if docker("image", "inspect", IMAGE, check=False).returncode != 0:
        pytest.fail(f"image {IMAGE} is missing: run `make test-docker` (docker/ci-setup.sh builds it)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Project:
    """One compose project: `docker-compose -p NAME --env-file DIR/env -f FILE...`."""

    def __init__(self, name: str, workdir: Path, files: tuple[str, ...], env: dict[str, str]):
        self.name, self.files = name, files
        self.status_port = free_port()
        self.env = {
            "RLHF_AUTH_TOKEN": TOKEN,
            "RLHF_REDIS_PASSWORD": "compose-test-redis-password",
            "RLHF_RUN": "run",
            "RLHF_IMAGE": IMAGE,
            "RLHF_STATUS_PORT": str(self.status_port),
            **env,
        }
        self.env_file = workdir / "env"
        self.env_file.write_text("".join(f"{k}={v}\n" for k, v in self.env.items()))
        self.events: list[dict] = []
        self._events_proc: subprocess.Popen | None = None

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        cmd = [*compose_binary(), "-p", self.name, "--env-file", str(self.env_file)]
        for f in self.files:
            cmd += ["-f", str(ROOT / f)]
        proc = subprocess.run([*cmd, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(
                f"compose {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
        return proc

    # ---------------------------------------------------------------- lifecycle
    def watch_events(self) -> None:
        """Record Docker's events for this project's containers (start, die, health_status) from now on."""
        self._events_proc = subprocess.Popen(
            [
                "docker",
                "events",
                "--filter",
                f"label=com.docker.compose.project={self.name}",
                "--filter",
                "type=container",
                "--format",
                "{{json .}}",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )

        def pump(out):
            for line in out:
                if line.strip():
                    self.events.append(json.loads(line))

        threading.Thread(target=pump, args=(self._events_proc.stdout,), daemon=True).start()

    def up(self, *args: str) -> None:
        self.compose("up", "-d", *args)

    def down(self, volumes: bool) -> subprocess.CompletedProcess:
        return self.compose("down", *(["-v"] if volumes else []), "--remove-orphans", "--timeout", "60")

    def close(self) -> None:
        """Remove everything of the project (also after a failed test) and stop watching events."""
        self.compose("down", "-v", "--remove-orphans", "--timeout", "10", check=False)
        if self._events_proc is not None:
            self._events_proc.terminate()
            self._events_proc.wait(timeout=10)

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, networks and volumes of this project that Docker still has."""
        label = f"label=com.docker.compose.project={self.name}"
        return {
            kind: docker(*cmd, "--filter", label, "-q").stdout.split()
            for kind, cmd in (
                ("containers", ("ps", "-a")),
                ("networks", ("network", "ls")),
                ("volumes", ("volume", "ls")),
            )
        }

    # ---------------------------------------------------------------- reading state
    def container(self, service: str, index: int = 1) -> str:
        return f"{self.name}_{service}_{index}"

    def state(self, service: str, index: int = 1) -> dict:
        return json.loads(docker("inspect", self.container(service, index)).stdout)[0]

    def logs(self, service: str) -> str:
        return self.compose("logs", "--no-color", service, check=False).stdout

    def status(self) -> dict | None:
        """The learner's /status (JSON), or None while it is not answering."""
        try:
            r = httpx.get(
                f"http://127.0.0.1:{self.status_port}/status", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5
            )
            return r.json() if r.status_code == 200 else None
        except (httpx.TransportError, ValueError):
            return None

    def iteration(self) -> int:
        s = self.status()
        return int(s.get("iteration", 0)) if s else -1

    def read(self, path: str) -> str:
        """A file of the `runs` volume (path under /runs), read by a throwaway container."""
        proc = docker(
            "run", "--rm", "--entrypoint", "cat", "-v", f"{self.name}_runs:/runs:ro", IMAGE, path, check=False
        )
        if proc.returncode != 0:
            raise FileNotFoundError(f"{path} in volume {self.name}_runs: {proc.stderr.strip()}")
        return proc.stdout

    def wait_for(self, pred, timeout_s: float, what: str):
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            v = pred()
            if v:
                return v
            time.sleep(0.5)
        raise AssertionError(
            f"timed out after {timeout_s:.0f} s waiting for {what}\n"
            f"{self.compose('ps', check=False).stdout}\n{self.logs('learner')[-4000:]}"
        )

    def wait_learner_done(self, timeout_s: float) -> int:
        """The learner's exit code once it has exited for good (not restarting)."""

        def done():
            st = self.state("learner")["State"]
            return st["Status"] == "exited" and not st["Restarting"] and (st["ExitCode"],)

        return self.wait_for(done, timeout_s, "the learner to finish")[0]

    def event_times(self, status: str) -> dict[str, list[float]]:
        """service -> the times (s) of its containers' events whose status starts with `status`."""
        out: dict[str, list[float]] = {}
        for e in self.events:
            if e.get("status", "").startswith(status):
                service = e["Actor"]["Attributes"].get("com.docker.compose.service", "?")
                out.setdefault(service, []).append(e["timeNano"] / 1e9)
        return out
