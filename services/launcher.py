"""`rlhf up`: the whole system on one machine, each service its own process.

    rlhf up -c configs/tiny-cpu.yaml --run-dir runs/tiny-cpu [--workers 2] [--generation-servers 2]

Starts an embedded Redis (unless replay.url is set), then the reward, critic, teacher (on-policy
distillation by a model of its own) and generation servers on free localhost ports, then the
learner and the rollout workers (and with --tinker the Tinker API on tinker.port; with
--tinker-generation also a generation server of the API's own, which decodes its samples; with
--tinker-trainer a trainer of its own, which holds its training models); waits for each
to be ready; shows the learner's progress;
restarts any service that crashes (Redis included) on the ports it had, up to --max-restarts
times each (a service after --restart-delay seconds, doubled at each further restart of it; Redis
at once); at the end, or on Ctrl-C, stops everything in order (the learner first, so it writes a
checkpoint).

Secrets: the Redis password and the auth token come from the config or their environment
variables; when unset, `rlhf up` generates them and keeps them in DIR/secrets.env (mode 0600).
Services get them through their environment, never on a command line.
Logs: DIR/logs/<service>.log; ports and pids: DIR/services.json (no secrets).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit, urlunsplit

from .common.lifecycle import EXIT_RUN_FAILED
from .common.model_files import check_model_dir
from .common.rpc import health
from .training.runlog import shown_path

if TYPE_CHECKING:
    from .common.config import Config
    from .common.replay.embedded import EmbeddedRedis

NICE_SAMPLERS = 10
HTTP_ONLY = ("rollout", "tinker")  # no gRPC health to ask: ready once they print LISTENING
PROGRESS_MARKERS = ("iter ", "done:", "resumed from", "stopped at", "Traceback", "Error", "ERROR")


class Child:
    """One service process: its command, log file, LISTENING line (its ports), readiness, and
    restarts. A gRPC service is ready when its health service says `rlhf.v1.<Name>` is SERVING;
    a rollout worker (no server) when it has registered, just before its LISTENING line."""

    def __init__(
        self,
        name: str,
        kind: str,
        cmd: list[str],
        log_dir: Path,
        echo: bool = False,
        nice: int = 0,
        env: dict | None = None,
    ):
        self.name, self.kind, self.cmd, self.echo, self.nice = name, kind, cmd, echo, nice
        self.env = env or {}
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.endpoints: dict[str, str] = {}
        self.listening = threading.Event()
        self.restarts = 0
        self.restart_due: float | None = None  # set while a crashed process waits out --restart-delay
        self.restarted_at: float | None = None  # set while a restarted process is not ready yet

    def start(self) -> "Child":
        self.endpoints, self.listening = {}, threading.Event()
        env = {**self.env, **os.environ, "PYTHONUNBUFFERED": "1"}
        nice = self.nice
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            # Ctrl-C reaches us only; we stop the children in order
            start_new_session=True,
            preexec_fn=(lambda: os.nice(nice)) if nice else None,
        )
        threading.Thread(target=self._pump, args=(self.proc, self.listening), daemon=True).start()
        return self

    def _pump(self, proc: subprocess.Popen, listening: threading.Event) -> None:
        assert proc.stdout is not None  # started with stdout=PIPE
        with self.log_path.open("ab") as log:
            for raw in proc.stdout:
                log.write(raw)
                log.flush()
                line = raw.decode(errors="replace").rstrip()
                if line.startswith("LISTENING "):
                    self.endpoints = dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)
                    listening.set()
                elif self.echo and any(m in line for m in PROGRESS_MARKERS):
                    print(f"[{self.name}] {line}" if "iter " not in line else line, flush=True)

    def _is_ready(self) -> bool:
        if not self.listening.is_set():
            return False
        if self.kind in HTTP_ONLY:  # its LISTENING line comes once it serves
            return True
        return health.check(f"127.0.0.1:{self.endpoints['port']}", health.readiness_name(self.kind))

    def wait_ready(self, timeout_s: float) -> dict:
        proc = self.proc
        assert proc is not None, f"{self.name} waited for before it was started"
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self._is_ready():
                return self.endpoints
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with code {proc.returncode} before it was ready; "
                    f"last lines of {self.log_path}:\n{tail(self.log_path)}"
                )
            self.listening.wait(0.2) if not self.listening.is_set() else time.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready after {timeout_s:.0f}s; see {self.log_path}")

    def pin_ports(self) -> None:
        """Replace the free ports asked for ("0") with the ones the service got, for restarts."""
        keys = {"--port": "http_port" if self.kind == "tinker" else "port", "--metrics-port": "metrics_port"}
        keys["--http-port"] = "http_port"
        for i, arg in enumerate(self.cmd[:-1]):
            value = self.endpoints.get(keys.get(arg, ""))
            if self.cmd[i + 1] == "0" and value and value != "None":
                self.cmd[i + 1] = str(value)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.alive():
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout_s: float) -> None:
        proc = self.proc
        assert proc is not None, f"{self.name} stopped before it was started"
        self.signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            print(f"{self.name} did not stop in {timeout_s:.0f}s; killing it", flush=True)
            proc.kill()
            proc.wait()

    def info(self) -> dict:
        return {
            "kind": self.kind,
            "pid": self.proc.pid if self.proc else None,
            "restarts": self.restarts,
            "log": str(self.log_path),
            **{k: (int(v) if v.isdigit() else v) for k, v in self.endpoints.items()},
        }


def tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


SECRET_KEYS = ("auth_token", "password")  # config keys whose --set values never go on a command line


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` readable by its owner only (0600), atomically."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def split_url_password(url: str | None) -> tuple[str | None, str | None]:
    """redis://:pw@host:port/0 -> (redis://host:port/0, pw)."""
    if not url:
        return url, None
    parts = urlsplit(url)
    if parts.password is None:
        return url, None
    host = parts.netloc.rpartition("@")[2]  # as written: an IPv6 address keeps its brackets
    user = f"{parts.username}@" if parts.username else ""
    # percent-encoded in the URL (a password with `@` or `/`), the password itself in the environment
    return urlunsplit((parts.scheme, user + host, parts.path, parts.query, parts.fragment)), unquote(parts.password)


class Launcher:
    def __init__(self, cfg: Config, args):
        self.cfg, self.args = cfg, args
        self.run_dir = Path(cfg.run.run_dir).resolve()
        self.log_dir = self.run_dir / "logs"
        self.children: dict[str, Child] = {}
        self.redis: EmbeddedRedis | None = None
        self.redis_restarts = 0
        self.url, url_password = split_url_password(cfg.replay.url)
        self.overrides = [o for o in args.overrides if o.split("=", 1)[0].rsplit(".", 1)[-1] not in SECRET_KEYS]
        self.env = self._secrets(url_password)
        self.stopping = threading.Event()

    def _secrets(self, url_password: str | None) -> dict[str, str]:
        """The environment that carries the secrets to every service: the configured ones, or
        for an embedded Redis / an unset token, generated ones kept in DIR/secrets.env (0600)."""
        cfg = self.cfg
        path = self.run_dir / "secrets.env"
        kept = {}
        if path.exists():
            kept = dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
        pw_env, tok_env = cfg.replay.password_env, cfg.rpc.auth_token_env
        password = url_password or cfg.replay.resolved_password()
        if password is None and not cfg.replay.url:  # our own Redis: never without a password
            password = kept.get(pw_env) or secrets.token_urlsafe(24)
        token = cfg.rpc.resolved_auth_token() or kept.get(tok_env) or secrets.token_urlsafe(24)
        env = {tok_env: token, **({pw_env: password} if password else {})}
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_private(path, "".join(f"{k}={v}\n" for k, v in env.items()))
        return env

    def _cmd(self, kind: str, sets: list[str], *extra: str) -> list[str]:
        cmd = [sys.executable, "-m", "services.cli", "serve", kind, "-c", self.args.config]
        for s in [*self.overrides, f"replay.url={self.url}", f"run.run_dir={self.run_dir}", *sets]:
            cmd += ["--set", s]
        return cmd + list(extra)

    def _spawn(self, name: str, kind: str, sets: list[str], *extra: str, echo: bool = False) -> Child:
        overlapped = self.cfg.max_staleness > 0 and kind in ("generation", "rollout", "reward", "teacher")
        # asynchronous mode: the learner is the critical path; sampling gets the cycles it leaves
        nice = NICE_SAMPLERS if overlapped else 0
        # processes that compute at the same time (learner and critic train together; in
        # asynchronous mode sampling overlaps training) must not leave OpenMP threads spinning
        # on the shared cores; a process that works alone is faster with the default spin-wait
        concurrent = overlapped or (kind in ("learner", "critic") and self.cfg.critic.overlap_training)
        env = {**self.env, **({"OMP_WAIT_POLICY": "PASSIVE"} if concurrent else {})}
        child = Child(name, kind, self._cmd(kind, sets, *extra), self.log_dir, echo, nice, env).start()
        self.children[name] = child
        return child

    def write_manifest(self) -> None:
        data = {
            "redis": self.url,
            "run_dir": str(self.run_dir),
            "secrets": str(self.run_dir / "secrets.env"),
            "redis_restarts": self.redis_restarts,
            "redis_pid": self.redis.proc.pid if self.redis is not None and self.redis.proc else None,
            "services": {n: c.info() for n, c in self.children.items()},
        }
        write_private(self.run_dir / "services.json", json.dumps(data, indent=2))

    def _start_redis(self) -> None:
        from .common.replay.embedded import EmbeddedRedis

        port = self.redis.port if self.redis is not None else None
        self.redis = EmbeddedRedis(
            self.run_dir / "redis",
            port=port,
            password=self.env.get(self.cfg.replay.password_env),
            appendfsync=self.cfg.replay.appendfsync,
        ).start()
        self.url = self.redis.public_url

    def start(self) -> None:
        cfg, args = self.cfg, self.args
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if not self.url:
            self._start_redis()
            assert self.redis is not None  # set by _start_redis
            print(
                f"embedded Redis on {self.redis.host}:{self.redis.port} (data in {shown_path(self.run_dir / 'redis')})",
                flush=True,
            )
        free = ["--port", "0", "--metrics-port", "0"]
        first = [self._spawn("reward", "reward", [], *free, "--http-port", "-1")]
        if cfg.needs_critic:
            first.append(self._spawn("critic", "critic", [], *free))
        if cfg.distill.needs_server:
            first.append(self._spawn("teacher", "teacher", [], *free))
        for i in range(args.generation_servers):
            first.append(self._spawn(f"generation-{i}", "generation", [], *free))
        own = self._tinker_own_servers(free)
        first += own.values()
        if getattr(args, "tinker", False) and not own:
            first.append(self._spawn_tinker([]))
        self._wait_ready(first)
        if own:  # the API learns its servers' ports once they are up
            sets = [f"tinker.{key}=127.0.0.1:{child.endpoints['port']}" for key, child in own.items()]
            self._wait_ready([self._spawn_tinker(sets)])
        self.sets = [f"rpc.reward.port={self.children['reward'].endpoints['port']}"]
        if cfg.needs_critic:
            self.sets.append(f"rpc.critic.port={self.children['critic'].endpoints['port']}")
        if cfg.distill.needs_server:  # the rollout workers (and the learner) reach it here
            self.sets.append(f"rpc.teacher.port={self.children['teacher'].endpoints['port']}")
        learner = self._spawn("learner", "learner", self.sets, *free, "--http-port", "0", echo=True)
        r = learner.wait_ready(args.startup_timeout)
        learner.pin_ports()
        print(
            f"learner ready on port {r.get('port')}; status at http://127.0.0.1:{r.get('http_port')}/status "
            f"(send 'Authorization: Bearer <{cfg.rpc.auth_token_env} in {shown_path(self.run_dir / 'secrets.env')}>')",
            flush=True,
        )
        for i in range(args.workers):
            self._spawn(f"rollout-{i}", "rollout", self.sets, "--metrics-port", "0", "--name", f"rollout-{i}")
        for i in range(args.workers):
            self.children[f"rollout-{i}"].wait_ready(args.startup_timeout)
        self.write_manifest()  # before the line that says the run is up
        print(f"{args.workers} rollout worker(s) running; logs in {shown_path(self.log_dir)}", flush=True)

    def _tinker_own_servers(self, free: list[str]) -> dict[str, Child]:
        """The Tinker API's own servers (--tinker-generation, --tinker-trainer), by the tinker.KEY
        that points the API at each. Its generation server is outside the run's registry (no
        replay.url), so the learner never pushes the run's policy to it; the API pushes its
        samplers' weights. Its trainer holds its clients' training models."""
        own = {}
        if getattr(self.args, "tinker_generation", False):
            own["generation"] = self._spawn("tinker-generation", "generation", ["replay.url=null"], *free)
        if getattr(self.args, "tinker_trainer", False):
            own["trainer"] = self._spawn("tinker-trainer", "tinker-trainer", [], *free)
        return own

    def _spawn_tinker(self, sets: list[str]) -> Child:
        """The Tinker API beside the run (--tinker): restarted like the others (a restart loses the
        models its clients held; their next request says so)."""
        return self._spawn("tinker", "tinker", sets, "--port", str(self.cfg.tinker.port))

    def _wait_ready(self, children: list[Child]) -> None:
        for c in children:
            r = c.wait_ready(self.args.startup_timeout)
            c.pin_ports()  # a restart comes back where the others look for it
            print(self._ready_line(c, r), flush=True)

    def _ready_line(self, c: Child, endpoints: dict) -> str:
        if c.kind != "tinker":
            return f"{c.name} ready on port {endpoints.get('port')}"
        cfg = self.cfg
        return (
            f"tinker API ready on http://{cfg.tinker.host}:{endpoints.get('http_port')} (TINKER_BASE_URL; "
            f"TINKER_API_KEY=tml-<{cfg.rpc.auth_token_env} in {shown_path(self.run_dir / 'secrets.env')}>)"
        )

    def _supervise_redis(self) -> int | None:
        """Restart a crashed embedded Redis on its port (its AOF brings the streams back); never
        once the shutdown began (a Redis that exits then was told to, or went with the run)."""
        if self.stopping.is_set():
            return None
        if self.redis is None or self.redis.proc is None or self.redis.proc.poll() is None:
            return None
        code = self.redis.proc.returncode
        if self.redis_restarts >= self.args.max_restarts:
            print(
                f"error: redis exited with code {code}; stopping the run (restarted {self.redis_restarts} times)",
                flush=True,
            )
            return code or 1
        self.redis_restarts += 1
        print(
            f"redis exited with code {code}; restarting it on port {self.redis.port} "
            f"({self.redis_restarts}/{self.args.max_restarts})",
            flush=True,
        )
        try:
            self._start_redis()
        except (RuntimeError, OSError) as e:
            print(f"error: {e}", flush=True)
            return 1
        self.write_manifest()
        return None

    def _check_back(self, c: Child) -> None:
        """A restarted service that became ready again: say so and record its new pid."""
        if c.restarted_at is None:
            return
        try:
            ready = c._is_ready()
        except Exception:
            ready = False
        if ready:
            print(f"{c.name} is back (restart {c.restarts})", flush=True)
            c.restarted_at = None
            self.write_manifest()
        elif time.time() - c.restarted_at > self.args.startup_timeout:
            print(
                f"error: {c.name} not ready {self.args.startup_timeout:.0f}s after its restart; see {c.log_path}",
                flush=True,
            )
            c.restarted_at = None

    def supervise(self) -> int:
        """Until the learner finishes: restart any service that exits before that (Redis too)."""
        learner = self.children["learner"]
        while not self.stopping.is_set():
            time.sleep(0.3)
            if self.stopping.is_set():  # a stop during the sleep: what exited since is not restarted
                break
            code = self.supervise_once(time.time())
            if code is not None:
                return code
        assert learner.proc is not None  # started by start()
        return learner.proc.returncode if learner.proc.poll() is not None else 130

    def supervise_once(self, now: float) -> int | None:
        """One look at every process at time `now`: restart what exited (a service once its
        --restart-delay has passed), say which restarted service is back. The run's exit code
        when it is over (the learner finished, or a service exited past --max-restarts)."""
        failed = self._supervise_redis()
        if failed is not None:
            return failed
        for name, c in list(self.children.items()):
            assert c.proc is not None  # every child is started when spawned
            code = c.proc.poll()
            if code is None:
                self._check_back(c)
                continue
            if name == "learner" and code == 0:
                return 0
            if self.stopping.is_set():
                return None
            if code == EXIT_RUN_FAILED:
                print(
                    f"error: {name} stopped the run (the run cannot go on). Last lines of {c.log_path}:\n"
                    f"{tail(c.log_path, 40)}",
                    flush=True,
                )
                return code
            if c.restart_due is None and c.restarts >= self.args.max_restarts:
                print(
                    f"error: {name} exited with code {code}; stopping the run. Last lines of {c.log_path}:\n"
                    f"{tail(c.log_path)}",
                    flush=True,
                )
                return code or 1
            if c.restart_due is None:
                c.restarts += 1
                delay = self.args.restart_delay * 2 ** (c.restarts - 1)  # a crash loop does not spin
                c.restart_due = now + delay
                print(
                    f"{name} exited with code {code}; restarting it"
                    + (f" in {delay:g}s" if delay else "")
                    + f" ({c.restarts}/{self.args.max_restarts})",
                    flush=True,
                )
            if now >= c.restart_due:
                c.restart_due = None
                c.start()
                c.restarted_at = now  # readiness is checked on the next rounds
                self.write_manifest()
        return None

    def shutdown(self) -> None:
        self.stopping.set()
        learner = self.children.get("learner")
        if learner is not None and learner.alive():
            learner.stop(timeout_s=120)  # it checkpoints first
        order = [c for c in self.children.values() if c.kind == "rollout"]
        servers = ("generation", "critic", "teacher", "reward", "tinker", "tinker-trainer")
        order += [c for c in self.children.values() if c.kind in servers]
        for c in order:
            c.signal(signal.SIGTERM)
        for c in order:
            if c.proc is not None:
                c.stop(timeout_s=30)
        if self.redis is not None:
            self.redis.stop()


def run_up(cfg: Config, args) -> int:
    try:
        check_model_dir(cfg.model.path)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    from .learner.checkpoint import finished_run

    run_dir = Path(cfg.run.run_dir).resolve()
    done = finished_run(run_dir, cfg.run.iterations)
    if done is not None:
        print(
            f"run {run_dir} already finished at iteration {done.get('iterations')} (summary.json); "
            f"raise run.iterations to continue",
            flush=True,
        )
        return 0
    launcher = Launcher(cfg, args)

    def on_signal(signum, frame):
        print("stopping: the learner writes a checkpoint, then every service shuts down", flush=True)
        launcher.stopping.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 1
    try:
        launcher.start()
        code = launcher.supervise()
    except (RuntimeError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
    finally:
        launcher.shutdown()
    summary = launcher.run_dir / "summary.json"
    if code == 0 and summary.exists():
        print(f"summary: {shown_path(summary)}", flush=True)
    return code
