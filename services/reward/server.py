"""The reward server: gRPC `Score`, and the same scorer over HTTP in OpenRLHF's remote reward
protocol (`POST /score` or `/get_reward`), so other frameworks can use it as their reward model.

    rlhf serve reward -c configs/tiny-cpu.yaml
"""
from __future__ import annotations

import json
import logging
import math
import re
import threading
from typing import Optional, Sequence

from pydantic import BaseModel, Field

from ..common.lifecycle import GrpcService
from ..common.modeling import load_tokenizer
from ..common.rpc.errors import BadRequest
from ..common.rpc.gen import reward_pb2 as rpb, reward_pb2_grpc
from ..common.rpc.server import RPCServer
from ..common.types import RewardSample

log = logging.getLogger(__name__)
MAX_SAMPLES = 65536


class RewardRequest(BaseModel):
    """OpenRLHF's remote reward request."""
    query: list[str] = Field(..., description="prompt + response per sample, decoded with special tokens kept")
    prompts: Optional[list[str]] = None
    labels: Optional[list[Optional[str]]] = None


def _check_scores(results) -> None:
    for i, r in enumerate(results):
        if not math.isfinite(r.reward):
            raise ValueError(f"scorer returned {r.reward} for sample {i}")


class RewardServicer(reward_pb2_grpc.RewardServicer):
    def __init__(self, scorer, metrics=None):
        self.scorer, self.metrics = scorer, metrics

    def Score(self, request, context):
        if not request.samples:
            raise BadRequest("samples: empty batch (0 samples)")
        if len(request.samples) > MAX_SAMPLES:
            raise BadRequest(f"samples: {len(request.samples)} samples, more than {MAX_SAMPLES}")
        samples = []
        for i, s in enumerate(request.samples):
            try:
                meta = json.loads(s.metadata_json) if s.metadata_json else {}
            except json.JSONDecodeError as e:
                raise BadRequest(f"samples[{i}].metadata_json: not JSON ({e})") from None
            if not isinstance(meta, dict):
                raise BadRequest(f"samples[{i}].metadata_json: must be a JSON object")
            samples.append(RewardSample(s.prompt, s.response, s.label if s.HasField("label") else None, meta))
        try:
            results = self.scorer.score(samples)
        except ValueError as e:  # a rule's own complaint about its input (e.g. a missing label)
            raise BadRequest(str(e)) from None
        _check_scores(results)
        if self.metrics:
            self.metrics.batch_size.labels(self.metrics.service, "samples").observe(len(samples))
        return rpb.ScoreResponse(scores=[rpb.Score(reward=r.reward, components=r.components) for r in results])


def special_token_strings(model_path) -> list[str]:
    """The non-empty BOS, EOS and pad token strings of the tokenizer at `model_path`, each once."""
    tok = load_tokenizer(model_path)
    return [t for t in dict.fromkeys((tok.bos_token, tok.eos_token, tok.pad_token)) if t]


def build_http_app(scorer, token: str | None = None, strip_tokens: Sequence[str] = ()):
    """FastAPI app answering OpenRLHF's remote reward request shape. Each query loses the runs of
    `strip_tokens` at its start and end (OpenRLHF decodes with special tokens kept: pads, BOS,
    a trailing EOS), each prompt those at its start, before the response is cut from the query."""
    from fastapi import FastAPI, Header, HTTPException

    # any of strip_tokens, the longest first; with none, (?!), which matches nothing
    runs = "|".join(re.escape(t) for t in sorted(set(strip_tokens) - {""}, key=len, reverse=True)) or "(?!)"
    leading, trailing = re.compile(f"^(?:{runs})+"), re.compile(f"(?:{runs})+$")
    app = FastAPI(title="rlhf reward", description="OpenRLHF-compatible remote reward model")

    def score(req: RewardRequest, authorization: str | None):
        if token is not None and authorization != f"Bearer {token}":
            raise HTTPException(401, "missing or wrong bearer token")
        n = len(req.query)
        if n == 0:
            raise HTTPException(422, "query: empty batch")
        prompts = req.prompts or [""] * n
        labels = req.labels or [None] * n
        if len(prompts) != n or len(labels) != n:
            raise HTTPException(422, f"query, prompts and labels must have one entry per sample ({n})")
        samples = []
        for q, p, l in zip(req.query, prompts, labels):
            q, p = trailing.sub("", leading.sub("", q)), leading.sub("", p)
            response = q[len(p):] if p and q.startswith(p) else q
            samples.append(RewardSample(p, response, l))
        try:
            results = scorer.score(samples)
        except ValueError as e:
            raise HTTPException(422, str(e))
        _check_scores(results)
        rewards = [r.reward for r in results]
        return {"rewards": rewards, "scores": rewards, "extra_logs": {
            k: [r.components.get(k) for r in results] for k in (results[0].components if results else {})}}

    @app.post("/score")
    def score_endpoint(req: RewardRequest, authorization: str | None = Header(None)):
        return score(req, authorization)

    @app.post("/get_reward")
    def get_reward(req: RewardRequest, authorization: str | None = Header(None)):
        return score(req, authorization)

    @app.get("/health")
    def healthz():
        return {"status": "ok"}

    return app


class HTTPServerThread:
    """uvicorn in a background thread, stoppable."""

    def __init__(self, app, host: str, port: int):
        import uvicorn
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="reward-http", daemon=True)

    def start(self, timeout: float = 10.0) -> int:
        import time
        self.thread.start()
        t0 = time.time()
        while not self.server.started:
            if time.time() - t0 > timeout or not self.thread.is_alive():
                raise RuntimeError("the reward HTTP server did not start")
            time.sleep(0.02)
        return self.server.servers[0].sockets[0].getsockname()[1]

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def serve(cfg, scorer=None, port: int | None = None, http_port: int | None = -1,
          metrics_port: int | None = -1) -> GrpcService:
    """The reward service: builds the scorer `reward` describes (or uses `scorer`), serves gRPC
    and, unless the HTTP port is None, OpenRLHF's HTTP protocol. Ports default to `rpc.reward`'s."""
    def build():
        sc = scorer
        if sc is None:
            from .scorer import build_scorer
            sc = build_scorer(cfg.reward, device=cfg.model.device if cfg.model.device != "auto" else "cpu")
        ep = cfg.rpc.reward
        server = RPCServer("reward", cfg.rpc, ep.port if port is None else port,
                           ep.metrics_port if metrics_port == -1 else metrics_port, host=ep.host)
        servicer = RewardServicer(sc, server.metrics)
        reward_pb2_grpc.add_RewardServicer_to_server(servicer, server.grpc)
        server.start()
        closers = []
        hp = ep.http_port if http_port == -1 else http_port
        if hp is not None:
            http = HTTPServerThread(build_http_app(sc, cfg.rpc.resolved_auth_token(), strip_tokens=special_token_strings(cfg.model.path)), ep.host, hp)
            server.http_port = http.start()
            closers.append(http.stop)
        server.set_ready(True)
        return server, servicer, closers
    return GrpcService("reward", build)
