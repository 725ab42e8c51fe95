"""The OpenAI-compatible HTTP API of the gateway: `/v1/chat/completions`, `/v1/completions`,
`/v1/models` (each also as `/sessions/{id}/v1/...`, the session named by the path), and the
sessions an agent's requests make (`/v1/sessions/{id}`); `/health` and `/metrics`.

One request, hop by hop (`build_app`, at the end, puts the app together from the helpers after
it, in this order: `_authorizer` for the Guard, the FastAPI app, `_completion_routes`, ...):
    Guard                         (common/rpc/http_guard.py) auth from the headers alone
                                  (`_authorizer`: the run's bearer token, or the key of the
                                  session the header or the path names), then the body read up
                                  to max_request_bytes (413 beyond)
    chat_completions              (`_completion_routes`, then Gateway.chat_completion) the request
                                  checked: finite floats, an int64 seed, int32 token ids, a
                                  bounded session id, the text's length against what
                                  prompt_length allows before it is tokenised, the token fields
                                  an assistant message carries back (`_echo`)
      Session.plan                token-exact: the session's tokens so far (or the echoed ones)
                                  + the new messages' (sessions.py)
      TurnSampler.generate        the session's generation server while it lives, else another
                                  (common/servers.py: Tries over the ServerPool, each server
                                  once); gRPC Generate on token ids
      _choices                    stop strings cut, text decoded, log-probs kept
      Session.apply               the turn's choices pending until the next request takes one
    _turn_answer                  the answer, as JSON or (`stream`) server-sent events: each
                                  choice with NeMo Gym's token fields: prompt_token_ids,
                                  generation_token_ids, generation_log_probs (sessions.py)
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import math
import re
import threading
import time
import uuid
from typing import Any, Callable, Union

import grpc
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..agents.sessions import (
    TOKEN_FIELDS,
    ChatTokens,
    Choice,
    Echo,
    NotTokenExact,
    Plan,
    Session,
    Sessions,
    without_token_fields,
)
from ..agents.tools import parse_tool_calls
from ..common.rpc.errors import Reason, reason_of
from ..common.rpc.http_guard import Guard, document_guard, error_body, install_error_handlers
from ..common.servers import Fault, RetryPolicy, Tries
from ..common.types import SamplingParams
from .metrics import GatewayMetrics

log = logging.getLogger(__name__)

SESSION_HEADER = "x-session-id"
POLICY_VERSION_HEADER = "x-policy-version"
AVOID_S = 10.0  # a generation server that failed a call is left out this long
HEALTH_CACHE_S = 1.0  # /health asks a generation server at most this often
INT64 = 2**63  # a seed is an int64 on the wire (generation.proto)
INT32 = 2**31  # a token id is an int32 on the wire
SESSION_ID = re.compile(r"[\x20-\x7e]*")  # printable ASCII: it goes back in the x-session-id header
MAX_PROMPT_TOKENS = 1 << 17  # echoed prompts' bound without prompt_length (the generation server bounds its own)
SESSION_PATH = "/sessions/"  # /sessions/{id}/v1/...: the session named by the path
SESSION_SCOPED = ("/v1/chat/completions", "/v1/completions", "/v1/models")  # what that form serves


class _Request(BaseModel):
    # strict: a value of another JSON type is refused, not converted (`"seed": true` is not 1)
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: Union[str, list[str], None] = None
    n: int = Field(default=1, ge=1)
    logprobs: Any = None  # chat: a bool; completions: an int (how many alternatives; only the sampled one is given)
    seed: int | None = Field(default=None, ge=-INT64, lt=INT64)
    stream: bool = False  # answered as server-sent events, the whole turn in one chunk once sampled
    stream_options: dict | None = None  # {"include_usage": true}: a last chunk with the usage
    session_id: str | None = None  # or the x-session-id header


class ChatRequest(_Request):
    messages: list[dict] = Field(min_length=1)
    tools: list[dict] | None = None


class CompletionRequest(_Request):
    prompt: Union[str, list[int]]

    @field_validator("prompt")
    @classmethod
    def _token_ids(cls, prompt):
        if isinstance(prompt, list):
            bad = next((i for i, t in enumerate(prompt) if not 0 <= t < INT32), None)
            if bad is not None:
                raise ValueError(f"token id {prompt[bad]} at [{bad}] outside [0, 2^31)")
        return prompt


class RewardPost(BaseModel):
    model_config = ConfigDict(strict=True)

    reward: float = Field(allow_inf_nan=False)


# the `code` of a turn refused because its session's budget is spent: the conversation has no room
# left in response_length (OpenAI's own code for a context too long), or it had max_turns turns
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
MAX_TURNS_EXCEEDED = "max_turns_exceeded"
SESSION_TOO_LARGE = "session_too_large"  # a session holds more than max_session_bytes


class GatewayError(Exception):
    """An OpenAI-style error answer: HTTP `status`, `kind` (its "type"), a message, the request
    field at fault (`param`) and a `code` (a string, or None) a client may act on."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ):
        super().__init__(message)
        self.status, self.kind, self.code, self.param = status, kind, code, param


class TurnSampler:
    """Generate calls for sessions: each session's requests go to one generation server while it
    answers (its prefix cache stays warm); one that fails is avoided for a while and the call goes
    to another, each server tried once (`RETRY`). `servers`: the pool of generation servers
    (common/servers.py:ServerPool)."""

    RETRY = RetryPolicy(avoid_s=AVOID_S, each_once=True)

    def __init__(self, servers, timeout_s: float | Callable[[], float]):
        """`timeout_s`: a call's deadline, or what gives it at each call."""
        self.servers = servers
        self.timeout_s = timeout_s if callable(timeout_s) else (lambda: float(timeout_s))

    def generate(self, session: Session, prompt: list[int], params: SamplingParams, first: int):
        """`first`: how many of `prompt`'s tokens are its conversation's first prompt."""
        key = uuid.uuid4().hex  # one request: a retry on the same server joins its work
        # the session's server first, else a new one at the session's policy version if one is
        tries = Tries(self.servers, self.RETRY, session.min_version, first=session.server)
        for address in tries:
            if address is None:
                break
            try:
                result = self.servers.client(address).generate(
                    [prompt], params, timeout=self.timeout_s(), key=key, first_prompt_tokens=[first]
                )
            except ValueError as e:  # a value the wire cannot carry (the request's checks let none through)
                raise GatewayError(400, f"the request: {e}") from None
            except grpc.RpcError as e:
                _refused(e)
                log.warning("generation server %s failed (%s); the session goes on on another", address, e.code().name)
                tries.failed(address, Fault.FAILED)
                session.server = None
                continue
            session.server = address
            return result
        raise GatewayError(503, "no generation server is available", "service_unavailable", "no_generation_server")


def _refused(e: grpc.RpcError) -> None:
    """A failed Generate that no other server mends, as the gateway's answer: the request refused
    (400), or the server full (429)."""
    if reason_of(e) is Reason.PROMPT_INVALID or e.code() == grpc.StatusCode.INVALID_ARGUMENT:
        raise GatewayError(400, f"the request: {e.details()}") from None
    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        raise GatewayError(
            429, f"the generation server is full: {e.details()}", "rate_limit_error", "server_full"
        ) from None


def _stop_list(stop) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise GatewayError(400, "stop: an empty string", param="stop")
    if len(stops) > 4:
        raise GatewayError(400, f"stop: {len(stops)} sequences, at most 4", param="stop")
    return stops


def text_chars(value: Any) -> int:
    """How many characters the strings of a JSON-like value have together (its messages' text)."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return total


def max_token_chars(tokenizer) -> int:
    """The most characters one token stands for (the longest entry of the vocabulary, added
    tokens included): n tokens are never more than n times this many characters of text."""
    try:
        vocab = tokenizer.get_vocab()
        return max(1, max((len(t) for t in vocab), default=1))
    except Exception:  # a tokenizer without a vocabulary to read: a bound no BPE vocabulary passes
        return 64


class Gateway:
    """What the routes call: the sessions, the chat template and the tokenizer, the sampler."""

    def __init__(
        self,
        tokenizer,
        sampler: TurnSampler,
        sessions: Sessions,
        model_name: str,
        max_tokens: int,
        max_n: int,
        pinned: SamplingParams | None = None,
        max_turns: int | None = None,
        prompt_length: int | None = None,
        max_session_id_bytes: int = 256,
    ):
        """`pinned`: the temperature, top-p and top-k every request samples with, whatever it
        asks (a rollout worker's endpoint: the learner's log-probs are of that distribution).
        `max_tokens`: a session's budget of tokens after its first prompt (response_length);
        `max_turns`: of sampled turns in one session (None: no limit); `prompt_length`: the
        most tokens of a conversation's first prompt (None: the generation server says).
        `max_session_id_bytes`: the longest session id taken."""
        self.tok, self.sampler, self.sessions = tokenizer, sampler, sessions
        self.chat = ChatTokens(tokenizer)
        self.model_name, self.max_tokens, self.max_n, self.pinned = model_name, max_tokens, max_n, pinned
        self.max_turns, self.prompt_length, self.max_session_id_bytes = max_turns, prompt_length, max_session_id_bytes
        self.vocab_size = len(tokenizer)
        # the most tokens echoed fields may hold: a conversation's first prompt and its response_length
        self.max_context = (prompt_length if prompt_length is not None else MAX_PROMPT_TOKENS) + max_tokens
        self.token_chars = max_token_chars(tokenizer)
        self._health: tuple[float, str | None] = (-HEALTH_CACHE_S, None)
        self._health_lock = threading.Lock()

    def session_id(self, sid: str | None, param: str = "session_id") -> str | None:
        """`sid` if it is a session id this endpoint takes (printable ASCII, at most
        `max_session_id_bytes`), else GatewayError 400."""
        if sid is None:
            return None
        if len(sid) > self.max_session_id_bytes or not SESSION_ID.fullmatch(sid):
            raise GatewayError(
                400,
                f"{param}: a session id is 1 to {self.max_session_id_bytes} printable ASCII characters "
                f"(this one: {len(sid)} characters)",
                param=param,
            )
        return sid

    def unavailable(self) -> str | None:
        """Why the endpoint cannot serve now (no generation server is listed, or none of them
        answers GetInfo within a second), or None when it can. Asked at most once a second."""
        with self._health_lock:
            at, why = self._health
            if time.monotonic() - at < HEALTH_CACHE_S:
                return why
            why = self._reachable()
            self._health = (time.monotonic(), why)
            return why

    def _reachable(self) -> str | None:
        servers = self.sampler.servers
        try:
            live = sorted(servers.live())
        except Exception as e:  # the registry (Redis) did not answer
            return f"the registry of generation servers did not answer: {type(e).__name__}"
        if not live:
            return "no generation server is registered"
        for address in live:
            try:
                servers.client(address).info(timeout=1.0)
                return None
            except Exception:
                continue
        return f"none of the {len(live)} generation servers answers"

    def _check_text(self, value: Any, param: str, tokens: int, bound: str) -> None:
        """Refuse text that cannot be `tokens` tokens or fewer (`bound` says which), before
        tokenising it: more characters than `tokens` times the longest token's."""
        chars = text_chars(value)
        if chars > tokens * self.token_chars:
            raise GatewayError(
                400,
                f"{param}: {chars} characters of text, more than {tokens} tokens can be ({bound})",
                code=CONTEXT_LENGTH_EXCEEDED,
                param=param,
            )

    def _check_first(self, plan: Plan, param: str) -> None:
        if self.prompt_length is not None and plan.first > self.prompt_length:
            raise GatewayError(
                400,
                f"{param}: a first prompt of {plan.first} tokens, more than prompt_length={self.prompt_length}",
                code=CONTEXT_LENGTH_EXCEEDED,
                param=param,
            )

    def _params(self, req: _Request, stops: list[str]) -> SamplingParams:
        if req.n > self.max_n:
            raise GatewayError(400, f"n: {req.n}, more than this server's {self.max_n}", param="n")
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

    def _choices(self, completions, policy_version: int, stops: list[str], tools: bool = False) -> list[Choice]:
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
            choice = Choice(ids, log_probs, text, reason, policy_version)
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

    def _token_ids(self, value: Any, param: str, empty: bool) -> list[int]:
        if not isinstance(value, list):
            raise GatewayError(400, f"{param}: a list of token ids", param=param)
        if not value and not empty:
            raise GatewayError(400, f"{param}: empty", param=param)
        if len(value) > self.max_context:
            raise GatewayError(
                400,
                f"{param}: {len(value)} token ids, more than a conversation holds ({self.max_context})",
                code=CONTEXT_LENGTH_EXCEEDED,
                param=param,
            )
        for i, t in enumerate(value):
            if type(t) is not int or not 0 <= t < self.vocab_size:
                raise GatewayError(
                    400, f"{param}[{i}]: {_shown(t)}, not a token id in [0, {self.vocab_size})", param=param
                )
        return value

    def _echo(self, messages: list[dict]) -> Echo | None:
        """NeMo Gym's token fields on the request's assistant messages, each message's checked (all
        three or none; token ids within the vocabulary, finite log-probs, as many as the ids, at
        most `max_context` tokens together): the last such message's as an `Echo`, or None."""
        found: list[tuple[int, list[int], list[int], list[float]]] = []
        for i, m in enumerate(messages):
            present = [k for k in TOKEN_FIELDS if k in m]
            if not present:
                continue
            at = f"messages[{i}]"
            if m.get("role") != "assistant":
                raise GatewayError(
                    400,
                    f"{at}: {', '.join(present)} on a {_shown(m.get('role'))} message (only an assistant "
                    "message carries them back)",
                    param=f"{at}.{present[0]}",
                )
            missing = [k for k in TOKEN_FIELDS if k not in m]
            if missing:
                raise GatewayError(
                    400, f"{at}: {', '.join(missing)} missing (the three go together)", param=f"{at}.{missing[0]}"
                )
            prompt = self._token_ids(m["prompt_token_ids"], f"{at}.prompt_token_ids", empty=False)
            generation = self._token_ids(m["generation_token_ids"], f"{at}.generation_token_ids", empty=True)
            param = f"{at}.generation_log_probs"
            log_probs = m["generation_log_probs"]
            if not isinstance(log_probs, list):
                raise GatewayError(400, f"{param}: a list of numbers", param=param)
            for j, lp in enumerate(log_probs):
                if type(lp) not in (int, float) or not math.isfinite(lp):
                    raise GatewayError(400, f"{param}[{j}]: {_shown(lp)}, not a finite number", param=param)
            if len(log_probs) != len(generation):
                raise GatewayError(
                    400, f"{param}: {len(log_probs)} log-probs for {len(generation)} generation_token_ids", param=param
                )
            if len(prompt) + len(generation) > self.max_context:
                raise GatewayError(
                    400,
                    f"{at}: {len(prompt) + len(generation)} tokens, more than a conversation holds "
                    f"({self.max_context})",
                    code=CONTEXT_LENGTH_EXCEEDED,
                    param=f"{at}.prompt_token_ids",
                )
            found.append((i, prompt, generation, [float(x) for x in log_probs]))
        if not found:
            return None
        k, prompt, generation, log_probs = found[-1]
        earliest = found[0][1]  # the conversation's first prompt, when the later ones go on from it
        first = len(earliest) if prompt[: len(earliest)] == earliest else len(prompt)
        return Echo(k, prompt, generation, log_probs, first)

    def chat_completion(self, req: ChatRequest, session_id: str | None) -> tuple[dict, Session, int]:
        if self.prompt_length is not None:
            bound = f"prompt_length={self.prompt_length} + response_length={self.max_tokens}"
            self._check_text([req.messages, req.tools], "messages", self.prompt_length + self.max_tokens, bound)

        echo = self._echo(req.messages)
        messages = [without_token_fields(m) for m in req.messages] if echo is not None else req.messages

        def plan_of(session: Session) -> Plan:
            try:
                plan = session.plan(self.chat, messages, req.tools, echo)
            except NotTokenExact as e:
                raise GatewayError(400, str(e), param=f"messages[{e.index}]") from None
            except Exception as e:  # the template refused the messages (a role it does not know)
                raise GatewayError(
                    400, f"messages: the chat template cannot render them ({str(e)[:500]})", param="messages"
                ) from None
            if not plan.went_on and session.segments:
                log.info("session %s: its messages do not extend its last turn; a new segment starts", session.id)
            self._check_first(plan, "messages")
            return plan

        def choice(i: int, c: Choice, prompt: list[int]) -> dict:
            message: dict = {"role": "assistant", "content": c.text}
            if c.tool_calls:
                message = {"role": "assistant", "content": c.text or None, "tool_calls": c.tool_calls}
            message.update(_token_fields(prompt, c))
            return {
                "index": i,
                "message": message,
                "finish_reason": c.finish_reason,
                "logprobs": {"content": self._logprobs(c)} if req.logprobs else None,
            }

        return self._answer(req, session_id, plan_of, "chat.completion", "chatcmpl", choice, tools=bool(req.tools))

    def completion(self, req: CompletionRequest, session_id: str | None) -> tuple[dict, Session, int]:
        if isinstance(req.prompt, list):
            ids = list(req.prompt)
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                raise GatewayError(
                    400, f"prompt: token id {bad} outside the vocabulary [0, {self.vocab_size})", param="prompt"
                )
        else:
            if self.prompt_length is not None:
                self._check_text(req.prompt, "prompt", self.prompt_length, f"prompt_length={self.prompt_length}")
            ids = self.chat.encode(req.prompt)
        if not ids:
            raise GatewayError(400, "prompt: empty", param="prompt")

        def plan_of(session: Session) -> Plan:
            plan = session.plan_raw(ids)
            self._check_first(plan, "prompt")
            return plan

        def choice(i: int, c: Choice, prompt: list[int]) -> dict:
            logprobs = {"tokens": [self.tok.decode([t]) for t in c.ids], "token_logprobs": c.log_probs}
            return {
                "index": i,
                "text": c.text,
                "finish_reason": c.finish_reason,
                "logprobs": logprobs if req.logprobs else None,
                **_token_fields(prompt, c),
            }

        return self._answer(req, session_id, plan_of, "text_completion", "cmpl", choice)

    def _answer(
        self, req: _Request, session_id: str | None, plan_of, kind: str, prefix: str, choice, tools: bool = False
    ):
        """One turn of a session: its prompt (`plan_of(session)`), sampled, cut at the stop
        strings, then recorded (a turn that fails changes nothing); the answer's body
        (`choice(i, c, prompt)` shapes each choice), the session and the policy version that sampled it."""
        stops = _stop_list(req.stop)
        params = self._params(req, stops)
        sid = self.session_id(session_id, "x-session-id") or self.session_id(req.session_id)
        session = self.sessions.get(sid)
        if session is None:
            raise GatewayError(404, f"no session {sid!r} here (ended, or never opened)", code="session_not_found")
        with session.lock:
            if self.sessions.over_limit(session):
                raise GatewayError(
                    400,
                    f"session {session.id}: it holds {session.bytes} bytes, more than max_session_bytes="
                    f"{self.sessions.max_session_bytes}; end it (DELETE /v1/sessions/{{id}}) or start another",
                    code=SESSION_TOO_LARGE,
                    param="session_id",
                )
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
            self.sessions.resized(session)
        body = {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": req.model or self.model_name,
            "system_fingerprint": f"policy-v{result.policy_version}",
            "session_id": session.id,
            "choices": [choice(i, c, prompt) for i, c in enumerate(choices)],
            "usage": _usage(prompt, choices),
        }
        return body, session, result.policy_version


def _shown(value: Any) -> str:
    """A value of a request in an error message: its JSON, cut at 40 characters."""
    try:
        return json.dumps(value)[:40]
    except (TypeError, ValueError):
        return type(value).__name__


def _token_fields(prompt: list[int], c: Choice) -> dict:
    """NeMo Gym's token fields of a choice (`TOKEN_FIELDS`): the prompt the policy saw, the ids
    it sampled (as kept: a stop string cuts them) and their log-probs."""
    return {"prompt_token_ids": prompt, "generation_token_ids": c.ids, "generation_log_probs": c.log_probs}


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
    gateway: Gateway,
    token: str | None,
    policy_version=lambda: None,
    concurrency: int = 256,
    session_secret: str | None = None,
    max_request_bytes: int = 8 << 20,
    metrics: GatewayMetrics | None = None,
    open_metrics: bool = False,
):
    """The app over `gateway` (FastAPI behind `Guard`): every route but the probes (/health,
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
    _completion_routes(app, gateway, metrics)
    _model_routes(app, gateway, policy_version)
    _session_routes(app, gateway)
    _probe_routes(app, gateway)
    if metrics is not None:
        _metrics_route(app, metrics)
    open_paths = {"/health", "/health/live"} | ({"/metrics"} if open_metrics else set())
    document_guard(app, open_paths)
    observe = (lambda m, p, code, s: metrics.http(route_of(m, p), code, s)) if metrics is not None else None
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
    """The FastAPI app the routes join: `concurrency` threads for sync routes, a `GatewayError`
    answered in the OpenAI error shape (as every other error, `install_error_handlers`)."""
    from contextlib import asynccontextmanager

    import anyio.to_thread
    from fastapi import FastAPI, Request
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

    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, e: GatewayError):
        return JSONResponse(error_body(str(e), e.kind, e.param, e.code), status_code=e.status)

    return app


def _completion_routes(app, gateway: Gateway, metrics: GatewayMetrics | None) -> None:
    """POST /v1/chat/completions and /v1/completions, also as /sessions/{id}/v1/...: each request
    one turn of its session (`Gateway.chat_completion`, `Gateway.completion`), timed."""
    from fastapi import Header

    # a turn answers JSON, or server-sent events with `stream`
    turn_answers: dict[int | str, dict[str, Any]] = {
        200: {"content": {"application/json": {}, "text/event-stream": {}}}
    }

    def turn(work, req: _Request, x_session_id: str | None):
        t0 = time.perf_counter()
        out = work(req, x_session_id)
        if metrics is not None:
            metrics.turn_seconds.observe(time.perf_counter() - t0)
        return _turn_answer(req, *out)

    @app.post("/v1/chat/completions", responses=turn_answers)
    def chat_completions(req: ChatRequest, x_session_id: str | None = Header(None)):
        return turn(gateway.chat_completion, req, x_session_id)

    @app.post("/v1/completions", responses=turn_answers)
    def completions(req: CompletionRequest, x_session_id: str | None = Header(None)):
        return turn(gateway.completion, req, x_session_id)

    # the same routes with the session in the path (an agent given a base URL of its own session)
    @app.post("/sessions/{session_id:path}/v1/chat/completions", responses=turn_answers)
    def session_chat_completions(session_id: str, req: ChatRequest, x_session_id: str | None = Header(None)):
        return turn(gateway.chat_completion, req, _path_session(gateway, session_id, x_session_id))

    @app.post("/sessions/{session_id:path}/v1/completions", responses=turn_answers)
    def session_completions(session_id: str, req: CompletionRequest, x_session_id: str | None = Header(None)):
        return turn(gateway.completion, req, _path_session(gateway, session_id, x_session_id))


def _path_session(gateway: Gateway, session_id: str, x_session_id: str | None) -> str:
    """The session the path names (what auth read): a header naming another is refused."""
    if not session_id:
        raise GatewayError(400, "session_id: empty (the path is /sessions/{id}/v1/...)", param="session_id")
    sid = gateway.session_id(session_id)
    assert sid is not None
    if x_session_id is not None and x_session_id != sid:
        raise GatewayError(
            400, f"x-session-id names another session than the path ({sid[:60]!r})", param="x-session-id"
        )
    return sid


def _turn_answer(req: _Request, body: dict, session: Session, policy_version: int):
    """A turn's answer: its body as JSON, or with `stream` as server-sent events
    (`stream_chunks`); the session and the policy version that sampled it in the headers."""
    from fastapi.responses import JSONResponse, StreamingResponse

    headers = {SESSION_HEADER: session.id, POLICY_VERSION_HEADER: str(policy_version)}
    if not req.stream:
        return JSONResponse(body, headers=headers)
    usage = bool((req.stream_options or {}).get("include_usage"))
    events = [f"data: {json.dumps(chunk)}\n\n" for chunk in stream_chunks(body, usage)] + ["data: [DONE]\n\n"]
    return StreamingResponse(iter(events), media_type="text/event-stream", headers=headers)


def _model_routes(app, gateway: Gateway, policy_version: Callable[[], int | None]) -> None:
    """GET /v1/models (also as /sessions/{id}/v1/models): the served model, at the policy
    version the servers serve now."""
    from fastapi import Header

    @app.get("/sessions/{session_id:path}/v1/models")
    def session_models(session_id: str, x_session_id: str | None = Header(None)):
        _path_session(gateway, session_id, x_session_id)
        return models()

    @app.get("/v1/models")
    def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": gateway.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "rlhf",
                    "policy_version": policy_version(),
                }
            ],
        }


def _session_routes(app, gateway: Gateway) -> None:
    """/v1/sessions/{id}: a session's record (GET), its agent's reward (POST .../reward), its end
    (DELETE, answering its record)."""

    def not_found(session_id: str) -> GatewayError:
        return GatewayError(
            404, f"no session {session_id!r} (ended, or idle past its time to live)", code="session_not_found"
        )

    @app.get("/v1/sessions/{session_id:path}")
    def session_record(session_id: str):
        session = gateway.sessions.find(gateway.session_id(session_id) or "")
        if session is None:
            raise not_found(session_id)
        return session.record()

    @app.post("/v1/sessions/{session_id:path}/reward")
    def post_reward(session_id: str, body: RewardPost):
        """An agent's reward for its session (an agent service's way to report it)."""
        session = gateway.sessions.find(gateway.session_id(session_id) or "")
        if session is None:
            raise not_found(session_id)
        session.set_reward(body.reward)
        return {"id": session_id, "reward": body.reward}

    @app.delete("/v1/sessions/{session_id:path}")
    def end_session(session_id: str):
        session = gateway.sessions.end(gateway.session_id(session_id) or "")
        if session is None:
            raise not_found(session_id)
        return session.record()


def _probe_routes(app, gateway: Gateway) -> None:
    """GET /health (readiness) and /health/live (liveness), open without the token."""

    @app.get("/health")
    def health():
        """200 when a generation server answers (the endpoint can serve), else 503 saying why."""
        why = gateway.unavailable()
        if why is not None:
            raise GatewayError(503, f"the gateway cannot serve: {why}", "service_unavailable", "no_generation_server")
        return {"status": "ok", "sessions": len(gateway.sessions)}

    @app.get("/health/live")
    def alive():
        """200 while the process answers HTTP, whatever the generation servers' state (a
        liveness probe: restarting the gateway would lose its sessions and fix no server)."""
        return {"status": "alive"}


def _metrics_route(app, metrics: GatewayMetrics) -> None:
    """GET /metrics: the gateway's metrics in Prometheus' text format."""
    from fastapi.responses import PlainTextResponse

    @app.get("/metrics", response_class=PlainTextResponse)
    def prometheus():
        return PlainTextResponse(metrics.exposition(), media_type=metrics.content_type)
