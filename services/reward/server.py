"""The reward server: gRPC `Score`, and the same scorer over HTTP in OpenRLHF's remote reward
protocol (`POST /score` or `/get_reward`), so other frameworks can use it as their reward model;
`GET /status` there shows the user's reward API and its circuit breaker (`http_scorer.py`).
Score requests marked `held_out` (the learner's held-out evaluation) are scored by
`reward.eval_rules` when they are set, a gold reward the policy is not trained on.

An HTTP request, hop by hop (`build_http_app` puts the app together from the helpers after it):
    Guard                         (common/rpc/http_guard.py) the bearer token, from the headers
                                  alone; then the body read up to max_request_bytes (413 beyond)
    score_endpoint, get_reward    (`_score_routes`) POST /score, /get_reward
      parse_reward_request        strict UTF-8 JSON (400), a RewardRequest (422)
      _openrlhf_samples           the special tokens stripped, each response cut from its query
                                  after its prompt, the lengths checked (422)
      scorer.score                in a worker thread (422: a rule's complaint about its input;
                                  503: the reward API behind it is down)
      _openrlhf_answer            rewards, scores, extra_logs

    rlhf serve reward -c configs/tiny-cpu.yaml
"""

from __future__ import annotations

import json
import logging
import math
from typing import TYPE_CHECKING, Optional, Sequence

from prometheus_client import CollectorRegistry
from pydantic import BaseModel, Field, ValidationError
from starlette.requests import Request  # at module level: FastAPI resolves the handlers' annotations here

from ..common.lifecycle import GrpcService, HTTPServerThread
from ..common.model_files import load_tokenizer
from ..common.rpc.errors import BadRequest, DeadlineExceeded, FailedPrecondition, Reason, Unavailable
from ..common.rpc.gen import reward_pb2 as rpb
from ..common.rpc.gen import reward_pb2_grpc
from ..common.rpc.http_guard import Guard, bearer, document_guard, install_error_handlers
from ..common.rpc.server import RPCServer, batch_size_histogram
from ..common.types import RewardSample
from .functions import RewardFunctionError
from .http_scorer import api_scorers
from .metrics import HTTPMetrics, RewardAPIMetrics, path_label

if TYPE_CHECKING:
    from ..common.config import Config

log = logging.getLogger(__name__)
MAX_SAMPLES = 65536
MAX_METADATA_CHARS = 64 * 1024
MAX_ERROR_CHARS = 4000  # of a failed reward function's message and traceback, in the status details
SLICE_SAMPLES = 512  # a round of the HTTP scorer's default requests (64 x 8 in parallel)
SLICE_CHARS = 1 << 20


class RewardRequest(BaseModel):
    """OpenRLHF's remote reward request."""

    query: list[str] = Field(
        ..., max_length=MAX_SAMPLES, description="prompt + response per sample, decoded with special tokens kept"
    )
    prompts: Optional[list[str]] = Field(default=None, max_length=MAX_SAMPLES)
    labels: Optional[list[Optional[str]]] = Field(default=None, max_length=MAX_SAMPLES)


def _check_scores(results) -> None:
    for i, r in enumerate(results):
        if not math.isfinite(r.reward):
            raise ValueError(f"scorer returned {r.reward} for sample {i}")


def _check_lengths(fields: dict, limit: int) -> None:
    """BadRequest naming the first of `fields` (name: text or None) longer than `limit` characters."""
    for name, text in fields.items():
        if text is not None and len(text) > limit:
            raise BadRequest(f"{name}: {len(text)} characters, more than reward.max_text_chars={limit}")


def _slices(samples: Sequence[RewardSample], max_samples: int = SLICE_SAMPLES, max_chars: int = SLICE_CHARS):
    """Consecutive runs of samples, each at most `max_samples` long with at most `max_chars` of
    text (or one sample): the work between two deadline checks."""
    start = chars = 0
    for i, s in enumerate(samples):
        n = len(s.prompt) + len(s.response) + len(s.label or "")
        if i > start and (i - start == max_samples or chars + n > max_chars):
            yield samples[start:i]
            start, chars = i, 0
        chars += n
    if start < len(samples):
        yield samples[start:]


class RewardServicer(reward_pb2_grpc.RewardServicer):
    """`eval_scorer` answers requests marked `held_out` (None: `scorer` does); `batch_size` is the
    `rlhf_batch_size` child that counts samples per call (None = not counted)."""

    def __init__(self, scorer, batch_size=None, max_text_chars: int = 100_000, eval_scorer=None):
        self.scorer, self.batch_size, self.max_text_chars = scorer, batch_size, max_text_chars
        self.eval_scorer = eval_scorer

    def Score(self, request, context):
        if not request.samples:
            raise BadRequest("samples: empty batch (0 samples)")
        if len(request.samples) > MAX_SAMPLES:
            raise BadRequest(f"samples: {len(request.samples)} samples, more than {MAX_SAMPLES}")
        samples = []
        for i, s in enumerate(request.samples):
            label = s.label if s.HasField("label") else None
            _check_lengths(
                {f"samples[{i}].prompt": s.prompt, f"samples[{i}].response": s.response, f"samples[{i}].label": label},
                self.max_text_chars,
            )
            if len(s.metadata_json) > MAX_METADATA_CHARS:
                raise BadRequest(
                    f"samples[{i}].metadata_json: {len(s.metadata_json)} characters, more than {MAX_METADATA_CHARS}"
                )
            try:
                meta = json.loads(s.metadata_json) if s.metadata_json else {}
            except json.JSONDecodeError as e:
                raise BadRequest(f"samples[{i}].metadata_json: not JSON ({e})") from None
            except RecursionError:
                raise BadRequest(f"samples[{i}].metadata_json: nested too deeply") from None
            if not isinstance(meta, dict):
                raise BadRequest(f"samples[{i}].metadata_json: must be a JSON object")
            samples.append(RewardSample(s.prompt, s.response, label, meta))
        scorer = self.eval_scorer if request.held_out and self.eval_scorer is not None else self.scorer
        results = []
        for part in _slices(samples):
            if context.time_remaining() <= 0:
                raise DeadlineExceeded(f"deadline passed after {len(results)} of {len(samples)} samples scored")
            try:
                results.extend(scorer.score(part))
            except RewardFunctionError as e:  # the user's function raised: the run must stop (the worker does)
                log.error("%s", e)
                raise FailedPrecondition(str(e)[-MAX_ERROR_CHARS:], Reason.REWARD_FUNCTION_FAILED) from None
            except ValueError as e:  # a rule's own complaint about its input (e.g. a missing label)
                raise BadRequest(str(e)) from None
        _check_scores(results)
        if self.batch_size is not None:
            self.batch_size.observe(len(samples))
        return rpb.ScoreResponse(scores=[rpb.Score(reward=r.reward, components=r.components) for r in results])


def reward_status(scorer) -> dict:
    """{"reward_api": the status of each reward API `scorer` calls ([] for none)}."""
    return {"service": "reward", "reward_api": [s.status() for s in api_scorers(scorer)]}


def special_token_strings(model_path) -> list[str]:
    """The non-empty BOS, EOS and pad token strings of the tokenizer at `model_path`, each once."""
    tok = load_tokenizer(model_path)
    return [t for t in dict.fromkeys((tok.bos_token, tok.eos_token, tok.pad_token)) if t]


def build_http_app(
    scorer,
    token: str | None = None,
    strip_tokens: Sequence[str] = (),
    max_text_chars: int = 100_000,
    metrics: HTTPMetrics | None = None,
    max_request_bytes: int = 64 << 20,
):
    """The app answering OpenRLHF's remote reward request shape (FastAPI behind `Guard`: the
    bearer `token` checked on the headers before the body, at most `max_request_bytes` of body,
    413 beyond). Each query loses the runs of `strip_tokens` at its start and end (OpenRLHF
    decodes with special tokens kept: pads, BOS, a trailing EOS), each prompt those at its start,
    before the response is cut from the query. Prompts, responses and labels are limited to
    `max_text_chars` (a query to twice that). Every error is `{"error": {"message", "type",
    "param", "code"}}`: 400 a body that is not strict JSON, 422 one that is not a reward request,
    401, 404, 405, 413, 503 (the reward API behind it is down), 500 a scorer that raised.
    `metrics` counts every request by path and status code (the 401s and 413s too), and times it.
    /openapi.json is behind the token; /docs and /redoc are off."""
    from fastapi import FastAPI

    tokens = sorted(set(strip_tokens) - {""}, key=len, reverse=True)
    app = FastAPI(
        title="rlhf reward", description="OpenRLHF-compatible remote reward model", docs_url=None, redoc_url=None
    )
    install_error_handlers(app, validation_status=422)
    _score_routes(app, scorer, tokens, max_text_chars)
    _status_routes(app, scorer)
    document_guard(app)
    observe = (lambda m, path, code, s: metrics.record(path_label(path), code, s)) if metrics is not None else None
    return Guard(app, authorized=bearer(token), max_body_bytes=max_request_bytes, observe=observe)


def _score_routes(app, scorer, tokens: Sequence[str], max_text_chars: int) -> None:
    """POST /score and /get_reward (the same): the body parsed (`parse_reward_request`), its
    samples cut from the queries (`_openrlhf_samples`), scored in a worker thread, answered as
    OpenRLHF reads it (`_openrlhf_answer`). `tokens`: the special tokens stripped, longest first."""
    from fastapi import HTTPException
    from starlette.concurrency import run_in_threadpool

    body_schema = {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": RewardRequest.model_json_schema()}},
        }
    }

    def score(req: RewardRequest):
        samples = _openrlhf_samples(req, tokens, max_text_chars)
        try:
            results = scorer.score(samples)
        except ValueError as e:
            raise HTTPException(422, str(e))
        except Unavailable as e:  # the reward API behind this server failed or is down
            raise HTTPException(503, str(e))
        _check_scores(results)
        return _openrlhf_answer(results)

    async def answer(request: Request):
        req = parse_reward_request(await request.body())
        return await run_in_threadpool(score, req)

    @app.post("/score", openapi_extra=body_schema)
    async def score_endpoint(request: Request):
        return await answer(request)

    @app.post("/get_reward", openapi_extra=body_schema)
    async def get_reward(request: Request):
        return await answer(request)


def parse_reward_request(raw: bytes) -> RewardRequest:
    """The body as a `RewardRequest`: strict UTF-8 JSON without NaN or Infinity."""
    from fastapi import HTTPException
    from fastapi.exceptions import RequestValidationError

    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError as e:
        raise HTTPException(400, f"body: not UTF-8 ({e.reason} at byte {e.start})") from None
    except (ValueError, RecursionError) as e:
        raise HTTPException(400, f"body: not JSON ({e})") from None
    for key in ("query", "prompts", "labels"):  # before a model of every sample is built (gRPC's Score bound)
        value = data.get(key) if isinstance(data, dict) else None
        if isinstance(value, list) and len(value) > MAX_SAMPLES:
            raise HTTPException(422, f"{key}: {len(value)} samples, more than {MAX_SAMPLES} in one request")
    try:
        return RewardRequest.model_validate(data)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in errors]) from None


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _openrlhf_samples(req: RewardRequest, tokens: Sequence[str], max_text_chars: int) -> list[RewardSample]:
    """The request's samples: each query without the runs of `tokens` at its ends, each prompt
    without those at its start, the response the query after its prompt (the whole query when
    it does not start with it); HTTPException 422 for a request of no sample, lists of other
    lengths, or text over `max_text_chars` (a query: twice that)."""
    from fastapi import HTTPException

    n = len(req.query)
    if n == 0:
        raise HTTPException(422, "query: empty batch")
    prompts = req.prompts or [""] * n
    labels = req.labels or [None] * n
    if len(prompts) != n or len(labels) != n:
        raise HTTPException(422, f"query, prompts and labels must have one entry per sample ({n})")
    samples = []
    for i, (q, p, lab) in enumerate(zip(req.query, prompts, labels)):
        if len(q) > 2 * max_text_chars:
            raise HTTPException(
                422,
                f"query[{i}]: {len(q)} characters, more than a prompt and a response "
                f"of reward.max_text_chars={max_text_chars} each",
            )
        q, p = _strip_runs(_strip_runs(q, tokens, True), tokens, False), _strip_runs(p, tokens, True)
        response = q[len(p) :] if p and q.startswith(p) else q
        try:
            _check_lengths(
                {f"prompts[{i}]": p, f"labels[{i}]": lab, f"query[{i}]'s response": response}, max_text_chars
            )
        except BadRequest as e:
            raise HTTPException(422, str(e)) from None
        samples.append(RewardSample(p, response, lab))
    return samples


def _strip_runs(s: str, tokens: Sequence[str], leading: bool) -> str:
    """`s` without the run of `tokens` (tried longest first) at its start or end; linear time."""
    i, j = 0, len(s)
    while True:
        t = next((t for t in tokens if (s.startswith(t, i, j) if leading else s.endswith(t, i, j))), None)
        if t is None:
            return s[i:j]
        i, j = (i + len(t), j) if leading else (i, j - len(t))


def _openrlhf_answer(results) -> dict:
    """The scores as OpenRLHF reads them: `rewards` (and the same as `scores`), and each
    component's values per sample in `extra_logs`."""
    rewards = [r.reward for r in results]
    return {
        "rewards": rewards,
        "scores": rewards,
        "extra_logs": {k: [r.components.get(k) for r in results] for k in (results[0].components if results else {})},
    }


def _status_routes(app, scorer) -> None:
    """GET /health, and /status: the reward API behind the scorer."""

    @app.get("/health")
    def healthz():
        return {"status": "ok"}

    @app.get("/status")
    def status():
        """The reward API this server calls (its URL without credentials) and its circuit breaker:
        closed, half_open or open, failures in a row, the last error."""
        return reward_status(scorer)


def serve(cfg: Config, scorer=None) -> GrpcService:
    """The reward service: builds the scorer `reward` describes (or uses `scorer`), then binds
    `rpc.reward`'s ports and serves gRPC and, unless `rpc.reward.http_port` is null, OpenRLHF's
    HTTP protocol."""

    def build():
        from .scorer import build_eval_scorer

        registry = CollectorRegistry()
        api_metrics, http_metrics = RewardAPIMetrics(registry), HTTPMetrics(registry)
        sc = scorer
        if sc is None:
            from .scorer import build_scorer

            sc = build_scorer(
                cfg.reward, device=cfg.model.device if cfg.model.device != "auto" else "cpu", api_metrics=api_metrics
            )
        eval_scorer = build_eval_scorer(cfg.reward)  # before any port is bound: a bad rule name fails here
        ep = cfg.rpc.reward
        server = RPCServer("reward", cfg.rpc, ep.port, ep.metrics_port, host=ep.host, registry=registry)
        servicer = RewardServicer(
            sc, batch_size_histogram(server.metrics, "samples"), cfg.reward.max_text_chars, eval_scorer=eval_scorer
        )
        reward_pb2_grpc.add_RewardServicer_to_server(servicer, server.grpc)
        server.start()
        closers = []
        if ep.http_port is not None:
            app = build_http_app(
                sc,
                cfg.rpc.resolved_auth_token(),
                strip_tokens=special_token_strings(cfg.model.path),
                max_text_chars=cfg.reward.max_text_chars,
                metrics=http_metrics,
                max_request_bytes=ep.max_request_bytes,
            )
            http = HTTPServerThread(app, ep.host, ep.http_port, name="reward-http")
            server.http_port = http.start()
            closers.append(http.stop)
        server.set_ready(True)
        return server, servicer, closers

    return GrpcService("reward", build)
