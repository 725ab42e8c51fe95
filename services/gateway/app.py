"""The OpenAI-compatible HTTP API of the gateway: `/v1/chat/completions`, `/v1/completions`,
`/v1/models`, and the sessions an agent's requests make (`/v1/sessions/{id}`).

One request, hop by hop:
    chat_completions              auth (the run's bearer token or the session's key), the request checked
      Session.prompt              token-exact: the session's tokens so far + the new messages'
                                  (sessions.py)
      Sampler.generate            the session's generation server while it lives, else another
                                  (ServerPool: pick, avoid); gRPC Generate on token ids
      _choices                    stop strings cut, text decoded, log-probs kept
      Session.sampled             the turn's choices pending until the next request takes one
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import time
import uuid
from typing import Any, Callable, Union

import grpc
from pydantic import BaseModel, ConfigDict, Field

from ..common.rpc.errors import Reason, reason_of
from ..common.types import SamplingParams
from .sessions import ChatTokens, Choice, Plan, Session, Sessions
from .tools import parse_tool_calls

log = logging.getLogger(__name__)

SESSION_HEADER = "x-session-id"
VERSION_HEADER = "x-policy-version"
AVOID_S = 10.0  # a generation server that failed a call is left out this long


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: Union[str, list[str], None] = None
    n: int = Field(default=1, ge=1)
    logprobs: Any = None  # chat: a bool; completions: an int (how many alternatives; only the sampled one is given)
    seed: int | None = None
    stream: bool = False  # answered as server-sent events, the whole turn in one chunk once sampled
    stream_options: dict | None = None  # {"include_usage": true}: a last chunk with the usage
    session_id: str | None = None  # or the x-session-id header


class ChatRequest(_Request):
    messages: list[dict] = Field(min_length=1)
    tools: list[dict] | None = None


class CompletionRequest(_Request):
    prompt: Union[str, list[int]]


class RewardPost(BaseModel):
    reward: float = Field(allow_inf_nan=False)


# the `code` of a turn refused because its session's budget is spent: the conversation has no room
# left in response_length (OpenAI's own code for a context too long), or it had max_turns turns
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
MAX_TURNS_EXCEEDED = "max_turns_exceeded"


class GatewayError(Exception):
    """An OpenAI-style error answer: HTTP `status`, `kind` (its "type"), a message, and a `code`
    (default the status) a client may act on."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.code = status, kind, code


class Sampler:
    """Generate calls for sessions: each session's requests go to one generation server while it
    answers (its prefix cache stays warm); one that fails is avoided for a while and the call goes
    to another. `servers`: the pool of generation servers (generation/client.py:ServerPool)."""

    def __init__(self, servers, timeout_s: float | Callable[[], float]):
        """`timeout_s`: a call's deadline, or what gives it at each call."""
        self.servers = servers
        self.timeout_s = timeout_s if callable(timeout_s) else (lambda: float(timeout_s))

    def generate(self, session: Session, prompt: list[int], params: SamplingParams, first: int):
        """`first`: how many of `prompt`'s tokens are its conversation's first prompt."""
        tried: set[str] = set()
        key = uuid.uuid4().hex  # one request: a retry on the same server joins its work
        while True:
            address = (  # a new server at the session's policy version if one is
                session.server if session.server not in (None, *tried) else self.servers.pick(session.min_version)
            )
            if address is None or address in tried:
                raise GatewayError(503, "no generation server is available", "service_unavailable")
            try:
                result = self.servers.client(address).generate(
                    [prompt], params, timeout=self.timeout_s(), key=key, first_prompt_tokens=[first]
                )
            except grpc.RpcError as e:
                if reason_of(e) is Reason.PROMPT_INVALID or e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise GatewayError(400, f"the request: {e.details()}") from None
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise GatewayError(429, f"the generation server is full: {e.details()}", "rate_limit") from None
                log.warning("generation server %s failed (%s); the session goes on on another", address, e.code().name)
                self.servers.avoid(address, AVOID_S)
                tried.add(address)
                session.server = None
                continue
            session.server = address
            return result


def _stop_list(stop) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise GatewayError(400, "stop: an empty string")
    if len(stops) > 4:
        raise GatewayError(400, f"stop: {len(stops)} sequences, at most 4")
    return stops


class Gateway:
    """What the routes call: the sessions, the chat template and the tokenizer, the sampler."""

    def __init__(
        self,
        tokenizer,
        sampler: Sampler,
        sessions: Sessions,
        model_name: str,
        max_tokens: int,
        max_n: int,
        pinned: SamplingParams | None = None,
        max_turns: int | None = None,
    ):
        """`pinned`: the temperature, top-p and top-k every request samples with, whatever it
        asks (a rollout worker's endpoint: the learner's log-probs are of that distribution).
        `max_tokens`: a session's budget of tokens after its first prompt (response_length);
        `max_turns`: of sampled turns in one session (None: no limit)."""
        self.tok, self.sampler, self.sessions = tokenizer, sampler, sessions
        self.chat = ChatTokens(tokenizer)
        self.model_name, self.max_tokens, self.max_n, self.pinned = model_name, max_tokens, max_n, pinned
        self.max_turns = max_turns

    def _params(self, req: _Request, stops: list[str]) -> SamplingParams:
        if req.n > self.max_n:
            raise GatewayError(400, f"n: {req.n}, more than this server's {self.max_n}")
        single = [self.tok(s, add_special_tokens=False)["input_ids"] for s in stops]
        pin = self.pinned
        return SamplingParams(
            n=req.n,
            temperature=pin.temperature if pin else req.temperature,
            top_p=pin.top_p if pin else req.top_p,
            top_k=pin.top_k if pin else 0,
            max_new_tokens=min(req.max_completion_tokens or req.max_tokens or self.max_tokens, self.max_tokens),
            stop_token_ids=[ids[0] for ids in single if len(ids) == 1],
            seed=req.seed,
        )

    def _choices(self, completions, version: int, stops: list[str], tools: bool = False) -> list[Choice]:
        """Each completion as returned: cut before its first stop string (its tokens up to the one
        that completes it are kept: the policy sampled them), its text without special tokens."""
        out = []
        for c in completions:
            ids, log_probs, reason = list(c.token_ids), list(c.log_probs), c.finish_reason
            text = self.tok.decode(ids, skip_special_tokens=True)
            cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
            if cut >= 0:
                text, reason = text[:cut], "stop"
                k = self._first_with_stop(ids, stops)
                ids, log_probs = ids[:k], log_probs[:k]
            choice = Choice(ids, log_probs, text, reason, version)
            if tools:  # the request offered tools: calls written in the reply come back as tool_calls
                content, calls = parse_tool_calls(text)
                if calls:
                    choice.text, choice.tool_calls, choice.finish_reason = content, calls, "tool_calls"
            out.append(choice)
        return out

    def _first_with_stop(self, ids: list[int], stops: list[str]) -> int:
        """The fewest leading tokens of `ids` whose text holds a stop string (a longer prefix holds
        it too: found by halving, log2(len) decodes)."""
        lo, hi = 1, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            text = self.tok.decode(ids[:mid], skip_special_tokens=True)
            if any(s in text for s in stops):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _logprobs(self, choice: Choice) -> list[dict]:
        out = []
        for t, lp in zip(choice.ids, choice.log_probs):
            token = self.tok.decode([t])
            out.append({"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": []})
        return out

    def chat_completion(self, req: ChatRequest, session_id: str | None) -> tuple[dict, Session, int]:
        def plan_of(session: Session) -> Plan:
            try:
                plan = session.plan(self.chat, req.messages, req.tools)
            except Exception as e:  # the template refused the messages (a role it does not know)
                raise GatewayError(400, f"messages: the chat template cannot render them ({e})") from None
            if not plan.went_on and session.segments:
                log.info("session %s: its messages do not extend its last turn; a new segment starts", session.id)
            return plan

        def choice(i: int, c: Choice) -> dict:
            message: dict = {"role": "assistant", "content": c.text}
            if c.tool_calls:
                message = {"role": "assistant", "content": c.text or None, "tool_calls": c.tool_calls}
            return {
                "index": i,
                "message": message,
                "finish_reason": c.finish_reason,
                "logprobs": {"content": self._logprobs(c)} if req.logprobs else None,
            }

        return self._answer(req, session_id, plan_of, "chat.completion", "chatcmpl", choice, tools=bool(req.tools))

    def completion(self, req: CompletionRequest, session_id: str | None) -> tuple[dict, Session, int]:
        ids = list(req.prompt) if isinstance(req.prompt, list) else self.chat.encode(req.prompt)
        if not ids:
            raise GatewayError(400, "prompt: empty")

        def plan_of(session: Session) -> Plan:
            return session.plan_raw(ids)

        def choice(i: int, c: Choice) -> dict:
            logprobs = {"tokens": [self.tok.decode([t]) for t in c.ids], "token_logprobs": c.log_probs}
            return {
                "index": i,
                "text": c.text,
                "finish_reason": c.finish_reason,
                "logprobs": logprobs if req.logprobs else None,
            }

        return self._answer(req, session_id, plan_of, "text_completion", "cmpl", choice)

    def _answer(
        self, req: _Request, session_id: str | None, plan_of, kind: str, prefix: str, choice, tools: bool = False
    ):
        """One turn of a session: its prompt (`plan_of(session)`), sampled, cut at the stop
        strings, then recorded (a turn that fails changes nothing); the answer's body
        (`choice(i, c)` shapes each choice), the session and the policy version that sampled it."""
        stops = _stop_list(req.stop)
        params = self._params(req, stops)
        sid = session_id or req.session_id
        session = self.sessions.get(sid)
        if session is None:
            raise GatewayError(404, f"no session {sid!r} here (ended, or never opened)", "not_found")
        with session.lock:
            plan = plan_of(session)
            prompt = plan.ids
            if self.max_turns is not None and plan.turn > self.max_turns:
                raise GatewayError(
                    400,
                    f"session {session.id}: turn {plan.turn}, more than this endpoint's max_turns={self.max_turns}",
                    code=MAX_TURNS_EXCEEDED,
                )
            room = self.max_tokens - (len(prompt) - plan.first)  # the session's budget: response_length
            if room < 1:
                raise GatewayError(
                    400,
                    f"session {session.id}: its conversation after the first prompt is {len(prompt) - plan.first} "
                    f"tokens, no room for another reply in response_length={self.max_tokens} (what the learner "
                    "trains on); end the session",
                    code=CONTEXT_LENGTH_EXCEEDED,
                )
            params = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, room))
            try:
                result = self.sampler.generate(session, prompt, params, plan.first)
            except GatewayError as e:
                if e.status in (429, 503):  # an outage its agent may report as its own failure
                    session.unavailable = True
                raise
            choices = self._choices(result.completions[0], result.policy_version, stops, tools)
            session.apply(plan, choices)
        body = {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": req.model or self.model_name,
            "system_fingerprint": f"policy-v{result.policy_version}",
            "session_id": session.id,
            "choices": [choice(i, c) for i, c in enumerate(choices)],
            "usage": _usage(prompt, choices),
        }
        return body, session, result.policy_version


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
            last = {"index": c["index"], "text": "", "finish_reason": c["finish_reason"]}
        out += [{**head, "choices": [first]}, {**head, "choices": [last]}]
    if usage:
        out.append({**head, "choices": [], "usage": body["usage"]})
    return out


def _usage(prompt: list[int], choices: list[Choice]) -> dict:
    completion = sum(len(c.ids) for c in choices)
    return {"prompt_tokens": len(prompt), "completion_tokens": completion, "total_tokens": len(prompt) + completion}


def session_key(secret: str, session_id: str) -> str:
    """The api key for one session (what an agent is given, not the run's token): derived from
    the secret of the one endpoint that opened the session (a rollout worker's), it is accepted
    there only and for that session only: not by another endpoint, not for another session, and
    it opens none (that endpoint creates no sessions)."""
    digest = hmac.new(secret.encode(), b"session:" + session_id.encode(), hashlib.sha256).hexdigest()
    return f"sk-session-{digest}"


def build_app(
    gateway: Gateway,
    token: str | None,
    version=lambda: None,
    concurrency: int = 256,
    session_secret: str | None = None,
):
    """The FastAPI app over `gateway`; every route but /health asks for the bearer `token` (when
    set) or, with `session_secret` (a rollout worker's endpoint), the session key of the session
    the request names: there a key is asked for even when the run has no token. `version()`:
    the policy version the servers serve now (for /v1/models). `concurrency`: requests answered
    at once (each holds a thread while its turn is sampled: as many as the generation servers
    batch, not the 40 threads FastAPI runs sync routes on by default)."""
    from contextlib import asynccontextmanager

    import anyio.to_thread
    from fastapi import FastAPI, Header, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    @asynccontextmanager
    async def lifespan(app):
        anyio.to_thread.current_default_thread_limiter().total_tokens = concurrency
        yield

    app = FastAPI(
        title="rlhf gateway", description="OpenAI-compatible endpoint with token-exact sessions", lifespan=lifespan
    )

    def check(authorization: str | None, session_id: str | None = None) -> None:
        """The run's token, or the key of the session the request names (`session_secret`'s)."""
        if token is None and session_secret is None:
            return
        given = (authorization or "").encode()
        if token is not None and hmac.compare_digest(given, f"Bearer {token}".encode()):
            return
        if (
            session_secret is not None
            and session_id
            and hmac.compare_digest(given, f"Bearer {session_key(session_secret, session_id)}".encode())
        ):
            return
        raise GatewayError(
            401,
            "missing or wrong bearer token (Authorization: Bearer <the run's token, or this session's key>)",
            "authentication_error",
        )

    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, e: GatewayError):
        error = {"message": str(e), "type": e.kind, "code": e.code or e.status}
        return JSONResponse({"error": error}, status_code=e.status)

    def answer(req: _Request, body: dict, session: Session, version: int):
        headers = {SESSION_HEADER: session.id, VERSION_HEADER: str(version)}
        if not req.stream:
            return JSONResponse(body, headers=headers)
        usage = bool((req.stream_options or {}).get("include_usage"))
        events = [f"data: {json.dumps(chunk)}\n\n" for chunk in stream_chunks(body, usage)] + ["data: [DONE]\n\n"]
        return StreamingResponse(iter(events), media_type="text/event-stream", headers=headers)

    @app.post("/v1/chat/completions")
    def chat_completions(
        req: ChatRequest,
        authorization: str | None = Header(None),
        x_session_id: str | None = Header(None),
    ):
        check(authorization, x_session_id or req.session_id)
        return answer(req, *gateway.chat_completion(req, x_session_id))

    @app.post("/v1/completions")
    def completions(
        req: CompletionRequest,
        authorization: str | None = Header(None),
        x_session_id: str | None = Header(None),
    ):
        check(authorization, x_session_id or req.session_id)
        return answer(req, *gateway.completion(req, x_session_id))

    @app.get("/v1/models")
    def models(authorization: str | None = Header(None), x_session_id: str | None = Header(None)):
        check(authorization, x_session_id)
        return {
            "object": "list",
            "data": [
                {
                    "id": gateway.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "rlhf",
                    "policy_version": version(),
                }
            ],
        }

    @app.get("/v1/sessions/{session_id:path}")
    def session_record(session_id: str, authorization: str | None = Header(None)):
        check(authorization, session_id)
        session = gateway.sessions.find(session_id)
        if session is None:
            raise GatewayError(404, f"no session {session_id!r} (ended, or idle past its time to live)", "not_found")
        return session.record()

    @app.post("/v1/sessions/{session_id:path}/reward")
    def post_reward(session_id: str, body: RewardPost, authorization: str | None = Header(None)):
        """An agent's reward for its session (an agent service's way to report it)."""
        check(authorization, session_id)
        session = gateway.sessions.find(session_id)
        if session is None:
            raise GatewayError(404, f"no session {session_id!r} (ended, or idle past its time to live)", "not_found")
        session.set_reward(body.reward)
        return {"id": session_id, "reward": body.reward}

    @app.delete("/v1/sessions/{session_id:path}")
    def end_session(session_id: str, authorization: str | None = Header(None)):
        check(authorization, session_id)
        session = gateway.sessions.end(session_id)
        if session is None:
            raise GatewayError(404, f"no session {session_id!r}", "not_found")
        return session.record()

    @app.get("/health")
    def health():
        return {"status": "ok", "sessions": len(gateway.sessions)}

    return app
