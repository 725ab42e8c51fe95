"""The Tinker API over HTTP (`build_app`): the paths the official `tinker` SDK calls, under
/api/v1, each a thin call of `TinkerApi` (api.py).

One request, hop by hop:
    Guard            (common/rpc/http_guard.py) the API key from the headers alone, before one
                     byte of the body is read (`X-API-Key: tml-<token>`, what the SDK sends, or
                     `Authorization: Bearer <token>`; everything when the server has no token),
                     then the body, up to tinker.max_request_bytes (413 beyond)
    the route        a JSON body read into its model (protocol.py: 400 naming the field), a
                     forward_backward's protobuf by wire.py; a POST with an X-Idempotency-Key
                     seen before answers what it answered then (`Replays`)
    TinkerApi        checks it against the server's state and limits, queues the work
    retrieve_future  held until the result is there or tinker.poll_hold_s passed (408, asked again)

Every error is the one shape, `{"error": {"message", "type", "param", "code"}}`, with a 4xx for
anything the client sent: never a 400 without a body (the SDK would take it for a proxy's)."""

from __future__ import annotations

import hmac
from collections import OrderedDict
from typing import Callable, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from ..common.rpc.http_guard import TYPES, Guard, error_body, field_path, install_error_handlers
from .api import TinkerApi, digest_of
from .futures import PROTOBUF
from .metrics import RouteLabels, TinkerMetrics
from .protocol import (
    ApiError,
    CreateModel,
    CreateSamplingSession,
    CreateSession,
    LoadWeights,
    ModelRef,
    OptimStep,
    Retrieve,
    Sample,
    SaveForSampler,
    SaveWeights,
    SessionRef,
)

PREFIX = "/api/v1"
OPEN_PATHS = frozenset({f"{PREFIX}/healthz"})
IDEMPOTENCY_HEADER = "x-idempotency-key"
M = TypeVar("M", bound=BaseModel)


def api_key(token: str | None) -> Callable[[str, str, dict[str, str]], bool]:
    """An `authorized` for the Guard: the SDK's `X-API-Key` (`tml-<token>`, or the token itself),
    or `Authorization: Bearer <token>`; anything when `token` is None."""
    accepted = [f"tml-{token}".encode(), token.encode()] if token is not None else []

    def authorized(method: str, path: str, headers: dict[str, str]) -> bool:
        if token is None:
            return True
        key = headers.get("x-api-key", "").encode()
        bearer = headers.get("authorization", "").removeprefix("Bearer ").encode()
        return any(hmac.compare_digest(given, want) for given in (key, bearer) for want in accepted)

    return authorized


def read(model: type[M], body: bytes) -> M:
    """The JSON body as `model`, or a 400 naming the first field at fault (never echoing it)."""
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as e:
        first = e.errors()[0]
        if first["type"] == "json_invalid":
            raise ApiError(400, "the body is not valid JSON") from None
        param = field_path(("body", *first["loc"]))
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise ApiError(400, f"{param or 'the body'}: {first['msg']}{more}", param=param) from None


class Replays:
    """The answers of POSTs that carried an X-Idempotency-Key, by path and key (at most `limit`):
    the same key again answers the same, a different body under it is refused."""

    def __init__(self, limit: int):
        self.limit = limit
        self._answers: OrderedDict[tuple[str, str], tuple[str, dict]] = OrderedDict()

    def answer(self, request: Request, body: bytes, make: Callable[[], dict]) -> dict:
        key = request.headers.get(IDEMPOTENCY_HEADER)
        if key is None:
            return make()
        slot, digest = (request.url.path, key[:256]), digest_of(body)
        seen = self._answers.get(slot)
        if seen is not None:
            if seen[0] != digest:
                raise ApiError(400, "X-Idempotency-Key: already used for another request", param=IDEMPOTENCY_HEADER)
            return seen[1]
        out = make()
        self._answers[slot] = (digest, out)
        while len(self._answers) > self.limit:
            self._answers.popitem(last=False)
        return out


def build_app(
    api: TinkerApi, token: str | None, metrics: TinkerMetrics | None = None, open_metrics: bool = False
) -> Guard:
    """The app over `api` behind `Guard`; with `metrics`, GET /metrics serves them (behind the key
    unless `open_metrics`) and every answered request is counted by its route."""
    app = FastAPI(
        title="rlhf tinker",
        description="A Tinker-compatible training API",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,  # the SDK is its schema: no /openapi.json (its routes read raw bodies)
    )
    install_error_handlers(app)

    @app.exception_handler(ApiError)
    async def refused(request: Request, e: ApiError):
        kind = TYPES.get(e.status, "server_error")
        return JSONResponse(error_body(e.message, kind, e.param, e.code), status_code=e.status)

    _configuration_routes(app, api)
    _session_routes(app, api, Replays(api.t.max_futures))
    _training_routes(app, api, Replays(api.t.max_futures))
    _sampling_routes(app, api, Replays(api.t.max_futures))
    observe = None
    if metrics is not None:
        _metrics_route(app, metrics)
        metrics.routes = RouteLabels(getattr(r, "path", "") for r in app.routes)
        observe = lambda method, path, code, seconds: metrics.request(path, code, seconds)  # noqa: E731
    return Guard(
        app,
        authorized=api_key(token),
        open_paths=OPEN_PATHS | ({"/metrics"} if open_metrics else set()),
        max_body_bytes=api.t.max_request_bytes,
        auth_hint="missing or wrong API key (X-API-Key: tml-<token>, the server's rpc.auth_token)",
        binary_types=frozenset({PROTOBUF}),
        observe=observe,
    )


def _metrics_route(app: FastAPI, metrics: TinkerMetrics) -> None:
    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.http.exposition(), media_type=metrics.http.content_type)


def _configuration_routes(app: FastAPI, api: TinkerApi) -> None:
    @app.get(f"{PREFIX}/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.post(f"{PREFIX}/client/config")
    async def client_config():
        return api.client_config()

    @app.post(f"{PREFIX}/client/dynamic_config")
    async def dynamic_config():
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False, "sample_cancel_max_batch_size": 64}

    @app.get(f"{PREFIX}/get_server_capabilities")
    async def capabilities():
        return api.capabilities()

    @app.post(f"{PREFIX}/telemetry")
    async def telemetry():  # the SDK's own reports (TINKER_TELEMETRY=0 turns them off): read, kept nowhere
        return {"status": "accepted"}


def _session_routes(app: FastAPI, api: TinkerApi, replays: Replays) -> None:
    @app.post(f"{PREFIX}/create_session")
    async def create_session(request: Request):
        body = await request.body()
        return replays.answer(request, body, lambda: api.create_session(read(CreateSession, body)))

    @app.post(f"{PREFIX}/session_heartbeat")
    async def heartbeat(request: Request):
        return api.heartbeat(read(SessionRef, await request.body()))

    @app.post(f"{PREFIX}/sessions/{{session_id}}/finish")
    async def finish(session_id: str):
        return api.finish(session_id)


def _training_routes(app: FastAPI, api: TinkerApi, replays: Replays) -> None:
    def route(path: str, model: type[BaseModel], call: Callable):
        async def handle(request: Request):
            body = await request.body()
            return replays.answer(request, body, lambda: call(read(model, body)))

        app.post(f"{PREFIX}/{path}")(handle)

    route("create_model", CreateModel, api.create_model)
    route("load_weights", LoadWeights, api.load_weights)
    route("optim_step", OptimStep, api.optim_step)
    route("save_weights", SaveWeights, api.save_weights)
    route("save_weights_for_sampler", SaveForSampler, api.save_for_sampler)

    @app.post(f"{PREFIX}/get_info")
    async def get_info(request: Request):
        return api.get_info(read(ModelRef, await request.body()))

    @app.post(f"{PREFIX}/forward_backward")
    async def forward_backward(request: Request):
        if request.headers.get("content-type", "").split(";")[0].strip() != PROTOBUF:
            raise ApiError(400, f"forward_backward takes a protobuf body (Content-Type: {PROTOBUF}), as the SDK sends")
        body = await request.body()
        return replays.answer(request, body, lambda: api.forward_backward(body))

    @app.get(f"{PREFIX}/training_runs/{{run_id}}")
    async def training_run(run_id: str):
        return api.training_run(run_id)

    @app.post(f"{PREFIX}/retrieve_future")
    async def retrieve(request: Request):
        req = read(Retrieve, await request.body())
        outcome = await api.retrieve(req)
        if outcome is None:
            body = error_body(f"request {req.request_id} is not done yet; ask again", code="try_again")
            return JSONResponse(
                {**body, "type": "try_again", "request_id": req.request_id, "queue_state": "active"}, 408
            )
        return Response(outcome.body, media_type=outcome.media_type)


def _sampling_routes(app: FastAPI, api: TinkerApi, replays: Replays) -> None:
    @app.post(f"{PREFIX}/create_sampling_session")
    async def create_sampling_session(request: Request):
        return api.create_sampling_session(read(CreateSamplingSession, await request.body()))

    @app.get(f"{PREFIX}/samplers/{{sampler_id}}")
    async def get_sampler(sampler_id: str):
        return api.get_sampler(sampler_id)

    @app.post(f"{PREFIX}/asample")
    async def asample(request: Request):
        body = await request.body()
        return replays.answer(request, body, lambda: api.sample(read(Sample, body)))
