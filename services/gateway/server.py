"""`rlhf serve gateway`: the OpenAI-compatible endpoint as a service of its own.

It holds the sessions, so a session outlives the generation server it was on: its next request
goes to another server with the same tokens. It reaches the generation servers through the replay
registry in a distributed run (`replay.url`: every live server, as the rollout workers do), else
the one at `rpc.generation`. It loads only the model's tokenizer and chat template.

On its HTTP port: the agents' endpoint (agents/routes.py over handler.py and protocol.py),
`/health` (200 while a generation server answers, else 503) and `/metrics` (metrics.py; behind the
token unless `rpc.open_metrics`). What one client can make
it hold is bounded by `rpc.gateway`'s keys: a request's bytes, a session id's, a session's, all
sessions' (docs/security.md says how much memory each allows)."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import grpc

from ..agents.handler import TurnHandler
from ..agents.routes import build_app
from ..agents.session_store import Sessions
from ..agents.turns import TurnSampler
from ..common.lifecycle import HTTPServerThread, Service
from ..common.model_files import load_tokenizer
from ..common.rpc.client import endpoint_address
from ..common.servers import ServerPool
from ..generation.client import generation_clients
from .metrics import GatewayMetrics

if TYPE_CHECKING:
    from ..common.config import Config

log = logging.getLogger(__name__)


class GatewayService(Service):
    name = "gateway"

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.http: HTTPServerThread | None = None
        self.servers: ServerPool | None = None
        self.store: object | None = None  # the replay store whose registry lists the servers
        self.fixed: str | None = None  # or the one configured server (no registry)
        self.port: int | None = None
        self.handler: TurnHandler | None = None
        self.metrics: GatewayMetrics | None = None
        self._done = threading.Event()

    def start(self) -> "GatewayService":
        cfg, ep = self.cfg, self.cfg.rpc.gateway
        if cfg.replay.url:
            from ..common.replay import ReplayStore

            store = self.store = ReplayStore.from_config(cfg)
            self.servers = ServerPool(
                lambda: store.live("generation"), generation_clients(cfg.rpc), cfg.replay.heartbeat_s / 2
            )
        else:
            self.fixed = endpoint_address(cfg.rpc.generation)
            self.servers = ServerPool.fixed(self.fixed, generation_clients(cfg.rpc))
        sessions = Sessions(
            ep.session_ttl_s,
            ep.max_sessions,
            max_bytes=ep.max_sessions_bytes,
            max_session_bytes=ep.max_session_bytes,
        )
        handler = TurnHandler(
            load_tokenizer(cfg.model.path),
            TurnSampler(self.servers, cfg.rpc.timeout_s),
            sessions,
            model_name=cfg.model.path,
            max_tokens=cfg.response_length,
            max_n=cfg.rpc.max_samples_per_prompt,
            prompt_length=cfg.prompt_length,
            max_session_id_bytes=ep.max_session_id_bytes,
            max_request_tokens=cfg.rpc.max_request_tokens,
        )
        self.handler, self.metrics = handler, GatewayMetrics(sessions)
        app = build_app(
            handler,
            cfg.rpc.resolved_auth_token(),
            policy_version=self._policy_version,
            max_request_bytes=ep.max_request_bytes,
            metrics=self.metrics,
            open_metrics=cfg.rpc.open_metrics,
        )
        self.http = HTTPServerThread(app, ep.host, ep.port, name="gateway-http")
        self.port = self.http.start()
        log.info("gateway: the OpenAI-compatible endpoint is on http://%s:%d/v1", ep.host, self.port)
        return self

    def _policy_version(self) -> int | None:
        """The newest policy version a live generation server reports (None when unknown): the
        registry's, or what the configured server answers (a deadline of a second: /v1/models does
        not wait for a server that is down)."""
        assert self.servers is not None
        if self.fixed is not None:
            try:
                return int(self.servers.client(self.fixed).info(timeout=1.0).policy_version)
            except grpc.RpcError:
                return None
        policy_versions = [int(e["policy_version"]) for e in self.servers.live().values() if "policy_version" in e]
        return max(policy_versions) if policy_versions else None

    def run(self) -> int:
        self._done.wait()
        return 0

    def drain(self) -> None:
        self._done.set()

    def stop(self) -> None:
        self._done.set()
        if self.http is not None:
            self.http.stop()
            self.http = None
        if self.servers is not None:
            self.servers.close()
            self.servers = None
        self.store = None

    @property
    def ready(self) -> bool:
        return self.http is not None

    def endpoints(self) -> dict:
        return {"http_port": self.port}


def serve(cfg: Config) -> GatewayService:
    return GatewayService(cfg)
