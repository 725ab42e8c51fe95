"""The agents' OpenAI-compatible endpoint as an ASGI app (`build_app`): `/v1/chat/completions`,
`/v1/completions`, `/v1/models` (each also as `/sessions/{id}/v1/...`, the session named by the
path), the sessions an agent's requests make (`/v1/sessions/{id}`), `/health` and `/metrics`.

One request, hop by hop (`build_app`, at the end, puts the app together from the helpers after
it, in this order: `_authorizer` for the Guard, the FastAPI app, `_completion_routes`, ...):
    Guard                         (common/rpc/http_guard.py) auth from the headers alone
                                  (`_authorizer`: the run's bearer token, or the key of the
                                  session the header or the path names), then the body read up
                                  to max_request_bytes (413 beyond)
    chat_completions              (`_completion_routes`) the request's models (protocol.py);
                                  the turn on a thread while `_hang_up` watches the client: a
                                  hang-up cancels the turn's Generate and records nothing
      TurnHandler.chat_completion (handler.py) the request checked against the endpoint's Limits:
                                  finite floats, an int64 seed, int32 token ids, a bounded session
                                  id, the text's length against what prompt_length allows before
                                  it is tokenised, the token fields an assistant message carries
                                  back (`Limits.echo`)
        Session.plan              token-exact: the session's tokens so far (or the echoed ones)
                                  + the new messages' (sessions.py)
        TurnSampler.generate      (turns.py) the session's generation server while it lives, else
                                  another (common/servers.py: Tries over the ServerPool, each
                                  server once); gRPC Generate on token ids
        TurnHandler._choices      stop strings cut, text decoded, log-probs kept
        Session.apply             the turn's choices pending until the next request takes one
    _turn_answer                  the answer, as JSON or (`stream`) server-sent events: each
                                  choice with NeMo Gym's token fields: prompt_token_ids,
                                  generation_token_ids, generation_log_probs (sessions.py)
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import json
import time
from typing import Any, Callable, Protocol

from starlette.requests import Request

from ..common.metrics import HttpMetrics
from ..common.rpc.client import Cancel
from ..common.rpc.http_guard import Guard, document_guard, error_body, install_error_handlers
from .handler import TurnHandler
from .protocol import (
    POLICY_VERSION_HEADER,
    SESSION_HEADER,
    ChatRequest,
    CompletionRequest,
    EndpointError,
    RewardPost,
    TurnRequest,
)
from .sessions import TOKEN_FIELDS, Session

SESSION_PATH = "/sessions/"  # /sessions/{id}/v1/...: the session named by the path
SESSION_SCOPED = ("/v1/chat/completions", "/v1/completions", "/v1/models")  # what that form serves


class EndpointMetrics(Protocol):
    """What the routes feed and serve, when the endpoint is measured (the gateway service's
    GatewayMetrics): each turn's seconds, each answered request, the exposition at /metrics."""

    turn_seconds: Any
    http: HttpMetrics


def stream_chunks(body: dict, usage: bool) -> list[dict]:
    """An answer as OpenAI's stream chunks: per choice, its whole message (or text) in one delta,
    then its finish reason; with `usage`, a last chunk of the usage alone. The turn is sampled
    before the first chunk (a stream for clients that ask for one, not token by token)."""
    chat = body["object"] == "chat.completion"
    head = {k: body[k] for k in ("id", "created", "model", "system_fingerprint", "session_id")}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    out = []
    for c in body["choices"]:
        if chat:
            delta = {k: v for k, v in c["message"].items() if v is not None}
            if "tool_calls" in delta:
                delta["tool_calls"] = [{"index": i, **t} for i, t in enumerate(delta["tool_calls"])]
            first = {"index": c["index"], "delta": delta, "logprobs": c["logprobs"], "finish_reason": None}
            last = {"index": c["index"], "delta": {}, "finish_reason": c["finish_reason"]}
        else:
            first = {"index": c["index"], "text": c["text"], "logprobs": c["logprobs"], "finish_reason": None}
            first.update({k: c[k] for k in TOKEN_FIELDS if k in c})
            last = {"index": c["index"], "text": "", "finish_reason": c["finish_reason"]}
        out += [{**head, "choices": [first]}, {**head, "choices": [last]}]
    if usage:
        out.append({**head, "choices": [], "usage": body["usage"]})
    return out


def session_key(secret: str, session_id: str) -> str:
    """The api key for one session (what an agent is given, not the run's token): derived from
    the secret of the one endpoint that opened the session (a rollout worker's), it is accepted
    there only and for that session only: not by another endpoint, not for another session, and
    it opens none (that endpoint creates no sessions)."""
    digest = hmac.new(secret.encode(), b"session:" + session_id.encode(), hashlib.sha256).hexdigest()
    return f"sk-session-{digest}"


def session_in_path(method: str, path: str) -> str | None:
    """The session a /v1/sessions/{id}[/reward] or /sessions/{id}/v1/... path names (what its
    route reads), else None."""
    if path.startswith(SESSION_PATH):
        for suffix in SESSION_SCOPED:
            if path.endswith(suffix) and len(path) > len(SESSION_PATH) + len(suffix):
                return path[len(SESSION_PATH) : -len(suffix)]
        return None
    prefix = "/v1/sessions/"
    if not path.startswith(prefix) or len(path) == len(prefix):
        return None
    sid = path[len(prefix) :]
    if method == "POST":
        return sid[: -len("/reward")] if sid.endswith("/reward") else None
    return sid


def route_of(method: str, path: str) -> str:
    """The `path` label of a request in the gateway's metrics: its route, else "other" (a
    scanner cannot grow the label set)."""
    if path in ROUTES:
        return path
    if path.startswith(SESSION_PATH):
        sid = session_in_path(method, path)
        return "other" if sid is None else "/sessions/{id}" + path[len(SESSION_PATH) + len(sid) :]
    sid = session_in_path(method, path)
    if sid is not None:
        return "/v1/sessions/{id}/reward" if method == "POST" else "/v1/sessions/{id}"
    return "other"


ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/health",
    "/health/live",
    "/metrics",
    "/openapi.json",
)


def build_app(
    handler: TurnHandler,
    token: str | None,
    policy_version=lambda: None,
    concurrency: int = 256,
    session_secret: str | None = None,
    max_request_bytes: int = 8 << 20,
    metrics: EndpointMetrics | None = None,
    open_metrics: bool = False,
):
    """The app over `handler` (FastAPI behind `Guard`): every route but the probes (/health,
    /health/live) asks for the bearer `token` (when set) or, with `session_secret` (a rollout
    worker's endpoint), the key of the session the request names in its path or else its
    `x-session-id` header: there a key is asked for even when the run has no token. Auth is
    decided on the headers alone, before the body (at most `max_request_bytes`) is read.
    `policy_version()`: the policy version the servers serve now (for /v1/models). `concurrency`:
    requests answered at once (each holds a thread while its turn is sampled: as many as the
    generation servers batch, not the 40 threads FastAPI runs sync routes on by default).
    `metrics`: served at /metrics (behind the token unless `open_metrics`), fed by every
    request. /openapi.json is behind the token like the API; FastAPI's /docs and /redoc pages
    are off (they fetch the schema without one)."""
    app = _fastapi_app(concurrency)
    _completion_routes(app, handler, metrics)
    _model_routes(app, handler, policy_version)
    _session_routes(app, handler)
    _probe_routes(app, handler)
    if metrics is not None:
        _metrics_route(app, metrics)
    open_paths = {"/health", "/health/live"} | ({"/metrics"} if open_metrics else set())
    document_guard(app, open_paths)
    observe = (lambda m, p, code, s: metrics.http.request(route_of(m, p), code, s)) if metrics is not None else None
    authorized = _authorizer(token, session_secret)
    return Guard(app, authorized=authorized, open_paths=open_paths, max_body_bytes=max_request_bytes, observe=observe)


def _authorizer(token: str | None, session_secret: str | None) -> Callable[[str, str, dict[str, str]], bool]:
    """`Guard`'s check, on a request's method, path and headers (the first hop: no body read yet)."""

    def authorized(method: str, path: str, headers: dict[str, str]) -> bool:
        """The run's token, or the key of the session the path (first) or the header names."""
        if token is None and session_secret is None:
            return True
        given = headers.get("authorization", "").encode("latin-1")
        if token is not None and hmac.compare_digest(given, f"Bearer {token}".encode()):
            return True
        sid = session_in_path(method, path) or headers.get(SESSION_HEADER)
        if session_secret is None or not sid:
            return False
        return hmac.compare_digest(given, f"Bearer {session_key(session_secret, sid)}".encode("utf-8", "replace"))

    return authorized


def _fastapi_app(concurrency: int):
    """The FastAPI app the routes join: `concurrency` threads for sync routes, an `EndpointError`
    answered in the OpenAI error shape (as every other error, `install_error_handlers`)."""
    from contextlib import asynccontextmanager

    import anyio.to_thread
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    @asynccontextmanager
    async def lifespan(app):
        anyio.to_thread.current_default_thread_limiter().total_tokens = concurrency
        yield

    app = FastAPI(
        title="rlhf gateway",
        description="OpenAI-compatible endpoint with token-exact sessions",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    install_error_handlers(app)

    @app.exception_handler(EndpointError)
    async def gateway_error(request: Request, e: EndpointError):
        return JSONResponse(error_body(str(e), e.kind, e.param, e.code), status_code=e.status)

    return app


def _completion_routes(app, handler: TurnHandler, metrics: EndpointMetrics | None) -> None:
    """POST /v1/chat/completions and /v1/completions, also as /sessions/{id}/v1/...: each request
    one turn of its session (`TurnHandler.chat_completion`, `TurnHandler.completion`), timed."""
    import anyio.to_thread
    from fastapi import Header

    # a turn answers JSON, or server-sent events with `stream`
    turn_answers: dict[int | str, dict[str, Any]] = {
        200: {"content": {"application/json": {}, "text/event-stream": {}}}
    }

    async def turn(request: Request, work, req: TurnRequest, x_session_id: str | None):
        """`work` on a thread, while the client is watched: a client that hangs up cancels the
        turn's sampling (the generation server stops), and nothing of it is recorded."""
        t0 = time.perf_counter()
        cancel = Cancel()
        watcher = asyncio.ensure_future(_hang_up(request, cancel))
        try:
            out = await anyio.to_thread.run_sync(functools.partial(work, req, x_session_id, cancel))
        finally:
            watcher.cancel()
        if metrics is not None:
            metrics.turn_seconds.observe(time.perf_counter() - t0)
        return _turn_answer(req, *out)

    @app.post("/v1/chat/completions", responses=turn_answers)
    async def chat_completions(request: Request, req: ChatRequest, x_session_id: str | None = Header(None)):
        return await turn(request, handler.chat_completion, req, x_session_id)

    @app.post("/v1/completions", responses=turn_answers)
    async def completions(request: Request, req: CompletionRequest, x_session_id: str | None = Header(None)):
        return await turn(request, handler.completion, req, x_session_id)

    # the same routes with the session in the path (an agent given a base URL of its own session)
    @app.post("/sessions/{session_id:path}/v1/chat/completions", responses=turn_answers)
    async def session_chat_completions(
        request: Request, session_id: str, req: ChatRequest, x_session_id: str | None = Header(None)
    ):
        sid = _path_session(handler, session_id, x_session_id)
        return await turn(request, handler.chat_completion, req, sid)

    @app.post("/sessions/{session_id:path}/v1/completions", responses=turn_answers)
    async def session_completions(
        request: Request, session_id: str, req: CompletionRequest, x_session_id: str | None = Header(None)
    ):
        sid = _path_session(handler, session_id, x_session_id)
        return await turn(request, handler.completion, req, sid)


async def _hang_up(request, cancel: Cancel) -> None:
    """Sets `cancel` when the client of `request` disconnects (its body is read: the next ASGI
    message is the disconnect, whenever it comes)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            cancel()
            return


def _path_session(handler: TurnHandler, session_id: str, x_session_id: str | None) -> str:
    """The session the path names (what auth read): a header naming another is refused."""
    if not session_id:
        raise EndpointError(400, "session_id: empty (the path is /sessions/{id}/v1/...)", param="session_id")
    sid = handler.limits.session_id(session_id)
    assert sid is not None
    if x_session_id is not None and x_session_id != sid:
        raise EndpointError(
            400, f"x-session-id names another session than the path ({sid[:60]!r})", param="x-session-id"
        )
    return sid


def _turn_answer(req: TurnRequest, body: dict, session: Session, policy_version: int):
    """A turn's answer: its body as JSON, or with `stream` as server-sent events
    (`stream_chunks`); the session and the policy version that sampled it in the headers."""
    from fastapi.responses import JSONResponse, StreamingResponse

    headers = {SESSION_HEADER: session.id, POLICY_VERSION_HEADER: str(policy_version)}
    if not req.stream:
        return JSONResponse(body, headers=headers)
    usage = bool((req.stream_options or {}).get("include_usage"))
    events = [f"data: {json.dumps(chunk)}\n\n" for chunk in stream_chunks(body, usage)] + ["data: [DONE]\n\n"]
    return StreamingResponse(iter(events), media_type="text/event-stream", headers=headers)


def _model_routes(app, handler: TurnHandler, policy_version: Callable[[], int | None]) -> None:
    """GET /v1/models (also as /sessions/{id}/v1/models): the served model, at the policy
    version the servers serve now."""
    from fastapi import Header

    @app.get("/sessions/{session_id:path}/v1/models")
    def session_models(session_id: str, x_session_id: str | None = Header(None)):
        _path_session(handler, session_id, x_session_id)
        return models()

    @app.get("/v1/models")
    def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": handler.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "rlhf",
                    "policy_version": policy_version(),
                }
            ],
        }


def _session_routes(app, handler: TurnHandler) -> None:
    """/v1/sessions/{id}: a session's record (GET), its agent's reward (POST .../reward), its end
    (DELETE, answering its record)."""

    def found(session_id: str, end: bool = False) -> Session:
        """The session the path names (ended with `end`), else 404."""
        sid = handler.limits.session_id(session_id) or ""
        session = handler.sessions.end(sid) if end else handler.sessions.find(sid)
        if session is None:
            raise EndpointError(
                404, f"no session {session_id!r} (ended, or idle past its time to live)", code="session_not_found"
            )
        return session

    @app.get("/v1/sessions/{session_id:path}")
    def session_record(session_id: str):
        return found(session_id).record()

    @app.post("/v1/sessions/{session_id:path}/reward")
    def post_reward(session_id: str, body: RewardPost):
        """An agent's reward for its session (an agent service's way to report it)."""
        found(session_id).set_reward(body.reward)
        return {"id": session_id, "reward": body.reward}

    @app.delete("/v1/sessions/{session_id:path}")
    def end_session(session_id: str):
        return found(session_id, end=True).record()


def _probe_routes(app, handler: TurnHandler) -> None:
    """GET /health (readiness) and /health/live (liveness), open without the token."""

    @app.get("/health")
    def health():
        """200 when a generation server answers (the endpoint can serve), else 503 saying why."""
        why = handler.sampler.unavailable()
        if why is not None:
            raise EndpointError(503, f"the gateway cannot serve: {why}", "service_unavailable", "no_generation_server")
        return {"status": "ok", "sessions": len(handler.sessions)}

    @app.get("/health/live")
    def alive():
        """200 while the process answers HTTP, whatever the generation servers' state (a
        liveness probe: restarting the gateway would lose its sessions and fix no server)."""
        return {"status": "alive"}


def _metrics_route(app, metrics: EndpointMetrics) -> None:
    """GET /metrics: the gateway's metrics in Prometheus' text format."""
    from fastapi.responses import PlainTextResponse

    @app.get("/metrics", response_class=PlainTextResponse)
    def prometheus():
        return PlainTextResponse(metrics.http.exposition(), media_type=metrics.http.content_type)
