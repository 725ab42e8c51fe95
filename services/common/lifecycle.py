"""One lifecycle for every service: `serve(cfg)` (in each service's package) returns a `Service`,
and `rlhf serve`, `rlhf up`, the container entrypoints and the tests all drive it the same way.

    svc = serve(cfg)          # nothing loaded or bound yet
    with svc:                 # start(): load, bind, serve; ready once it can do its job
        svc.run()             # blocks until the work ends or drain() was called
                              # __exit__: stop(), which releases everything

`drain()` is what SIGTERM does (`run_service` installs the one signal path): stop taking new
work, finish what is in flight, then let `run()` return. Readiness is reported through the
standard gRPC health service (`rlhf.v1.<Name>`), which is what probes and `rlhf up` ask.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from .rpc.server import RPCServer

log = logging.getLogger(__name__)


# the exit code of a service that found the run cannot go on, so that restarting it would not help
# (a user's reward function raised): `rlhf up` stops the run at once, showing its log
EXIT_RUN_FAILED = 3


class RunFailed(RuntimeError):
    """Raised in a service when the run cannot go on (a user's reward function raised): its
    process exits with EXIT_RUN_FAILED, and `rlhf up` stops the run."""


class Service:
    """Base of every service's handle. Subclasses implement `start`, `run`, `drain`, `stop`."""

    name: str = "service"

    def start(self) -> "Service":
        raise NotImplementedError

    def run(self) -> int:
        """Block until the service's work ends (a server: until drained). Returns an exit code."""
        raise NotImplementedError

    def drain(self) -> None:
        """Stop taking new work and let what is in flight finish; `run()` then returns."""
        raise NotImplementedError

    def stop(self) -> None:
        """Release ports, threads and clients. Idempotent."""
        raise NotImplementedError

    @property
    def ready(self) -> bool:
        raise NotImplementedError

    def endpoints(self) -> dict[str, int | str | None]:
        """What the LISTENING line reports: ports (a free one was picked for port 0), names."""
        return {}

    def __enter__(self) -> "Service":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


class GrpcService(Service):
    """A service that is one `RPCServer` (plus things to close after it): generation, reward and
    critic. `build` runs at start: it loads the model, binds the ports, starts serving and
    returns (server, servicer, the callables that release the rest, in order)."""

    def __init__(self, name: str, build: Callable[[], tuple[RPCServer, Any, list[Callable[[], None]]]]):
        self.name, self._build = name, build
        self.server: RPCServer | None = None
        self.servicer: Any = None  # the service's own servicer
        self._closers: list[Callable[[], None]] = []
        self._stopped = False

    def start(self) -> "GrpcService":
        self.server, self.servicer, self._closers = self._build()
        return self

    def run(self) -> int:
        assert self.server is not None  # start() built it
        self.server.wait()
        return 0

    def drain(self) -> None:
        if self.server is not None:
            self.server.stop()

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self.server is not None:
            self.server.stop()
        for close in self._closers:
            close()

    @property
    def ready(self) -> bool:
        return self.server is not None and self.server.is_ready()

    def endpoints(self) -> dict:
        s = self.server
        assert s is not None  # start() built it
        out = {"port": s.port, "metrics_port": s.metrics_port}
        http_port = getattr(s, "http_port", None)  # set by a server that also serves HTTP (reward)
        if http_port:
            out["http_port"] = http_port
        return out


def listening_line(svc: Service) -> str:
    """One machine-readable line for supervisors that start services on free ports."""
    parts = [f"service={svc.name}"] + [f"{k}={v}" for k, v in svc.endpoints().items()]
    return "LISTENING " + " ".join(parts)


def run_service(svc: Service, out=None) -> int:
    """Start `svc`, print its LISTENING line, run it until done or drained by SIGTERM/SIGINT,
    then stop it: the one signal path of every `rlhf serve`."""
    out = out or sys.stdout

    def on_signal(signum, frame):
        log.info("%s: signal %d, finishing the work in flight, then stopping", svc.name, signum)
        threading.Thread(target=svc.drain, name="drain", daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with svc:
        print(listening_line(svc), file=out, flush=True)
        try:
            return svc.run()
        except RunFailed as e:
            log.error("%s: the run cannot go on:\n%s", svc.name, e)
            return EXIT_RUN_FAILED


class HTTPServerThread:
    """An ASGI app (FastAPI) served by uvicorn in a background thread, stoppable: the HTTP side of
    a service (the reward server's OpenRLHF protocol, the gateway's OpenAI API)."""

    def __init__(self, app, host: str, port: int, name: str = "http", header_timeout_s: float | None = None):
        """Each connection's request headers are due within HEADER_TIMEOUT_S (a silent or
        trickling one is closed: rpc/http_connection.py), at most MAX_CONNECTIONS
        are held at once (a request beyond them is answered 503), an idle keep-alive connection
        closes after 5 s (uvicorn's own)."""
        import uvicorn

        from .rpc.http_connection import HEADER_TIMEOUT_S, MAX_CONNECTIONS, timed_protocol

        self.name = name
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            http=timed_protocol(header_timeout_s or HEADER_TIMEOUT_S),
            limit_concurrency=MAX_CONNECTIONS,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name=name, daemon=True)

    def start(self, timeout: float = 10.0) -> int:
        """Serve; the bound port (a free one for port 0)."""
        import time

        self.thread.start()
        t0 = time.time()
        while not self.server.started:
            if time.time() - t0 > timeout or not self.thread.is_alive():
                raise RuntimeError(f"the {self.name} HTTP server did not start")
            time.sleep(0.02)
        return self.server.servers[0].sockets[0].getsockname()[1]

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
