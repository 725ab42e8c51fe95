"""`rlhf serve tinker`: a Tinker-compatible training API on the one model of `model.path`, which the
official `tinker` SDK (and tinker-cookbook's recipes) talk to unchanged: `base_url` (or
$TINKER_BASE_URL) `http://HOST:PORT`, the API key `tml-<rpc.auth_token>` (docs/tinker.md).

In the process: what decodes samples (decoders.py: the `hf` generation backend here, or a
generation server of the API's own at `tinker.generation`), the training models clients create
(LoRA or full weights, each with its AdamW), all computed on one thread in the order the
requests came (api.py); the HTTP side is routes.py, its Prometheus metrics (GET /metrics)
metrics.py.
Checkpoints (tinker://) are files under `tinker.root`; everything else lives in this process: a
restarted server knows its checkpoints, not its clients' sessions, models or gradients."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from ..common.lifecycle import HTTPServerThread, Service
from .api import TinkerApi
from .decoders import decoder_for
from .metrics import TinkerMetrics
from .routes import build_app

if TYPE_CHECKING:
    from ..common.config import Config

log = logging.getLogger(__name__)


class TinkerService(Service):
    name = "tinker"

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.api: TinkerApi | None = None
        self.http: HTTPServerThread | None = None
        self.port: int | None = None
        self._done = threading.Event()

    def start(self) -> "TinkerService":
        cfg, t = self.cfg, self.cfg.tinker
        self.api = TinkerApi(cfg, decoder_for(cfg))
        metrics = TinkerMetrics(self.api)
        self.api.on_work = metrics.worked
        app = build_app(self.api, cfg.rpc.resolved_auth_token(), metrics, cfg.rpc.open_metrics)
        self.http = HTTPServerThread(app, t.host, t.port, "tinker-http")
        self.port = self.http.start()
        log.info(
            "tinker: the Tinker API serves %s on http://%s:%d (TINKER_BASE_URL; checkpoints in %s)",
            self.api.model_name,
            t.host,
            self.port,
            self.api.store.root,
        )
        return self

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
        if self.api is not None:
            self.api.close()
            self.api = None

    @property
    def ready(self) -> bool:
        return self.http is not None

    def endpoints(self) -> dict:
        return {"http_port": self.port}


def serve(cfg: Config) -> TinkerService:
    return TinkerService(cfg)
