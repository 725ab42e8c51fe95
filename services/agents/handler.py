"""One turn of a session at the agents' endpoint (`TurnHandler`): the request checked against the
endpoint's limits (protocol.py), its prompt planned token-exactly from the session so far
(sessions.py: `Session.plan`), sampled on a generation server (turns.py: `TurnSampler`), cut at its
stop strings, decoded, and recorded in the session; the answer's body in OpenAI's shape, each
choice with NeMo Gym's token fields. A turn that fails changes nothing in its session."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid

from ..common.rpc.client import Abandoned, Cancel
from ..common.types import SamplingParams
from .chat_tokens import ChatTokens, NotTokenExact
from .protocol import (
    CONTEXT_LENGTH_EXCEEDED,
    MAX_TURNS_EXCEEDED,
    SESSION_EVICTED,
    SESSION_TOO_LARGE,
    ChatRequest,
    CompletionRequest,
    EndpointError,
    Limits,
    TurnRequest,
    check_messages,
    max_token_chars,
)
from .session_store import Forgotten, Sessions
from .sessions import Choice, Plan, Session, without_token_fields
from .tools import parse_tool_calls
from .turns import TurnSampler

log = logging.getLogger(__name__)


class TurnHandler:
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
        max_request_tokens: int | None = None,
    ):
        """`pinned`: the temperature, top-p and top-k every request samples with, whatever it
        asks (a rollout worker's endpoint: the learner's log-probs are of that distribution).
        `max_tokens`: a session's budget of tokens after its first prompt (response_length);
        `max_turns`: of sampled turns in one session (None: no limit); `prompt_length`: the
        most tokens of a conversation's first prompt (None: the generation server says).
        `max_session_id_bytes`: the longest session id taken; `max_request_tokens`: what one
        Generate may cost (rpc.max_request_tokens; None: the generation server says)."""
        self.tok, self.sampler, self.sessions = tokenizer, sampler, sessions
        self.chat = ChatTokens(tokenizer)
        self.model_name, self.max_tokens, self.max_n, self.pinned = model_name, max_tokens, max_n, pinned
        self.max_turns, self.prompt_length = max_turns, prompt_length
        chars = max_token_chars(tokenizer)
        self.limits = Limits(len(tokenizer), prompt_length, max_tokens, chars, max_session_id_bytes, max_request_tokens)

    def chat_completion(
        self, req: ChatRequest, session_id: str | None, cancel: Cancel | None = None
    ) -> tuple[dict, Session, int]:
        check_messages(req.messages)
        if self.prompt_length is not None:
            bound = f"prompt_length={self.prompt_length} + response_length={self.max_tokens}"
            self.limits.text([req.messages, req.tools], "messages", self.prompt_length + self.max_tokens, bound)

        echo = self.limits.echo(req.messages)
        messages = [without_token_fields(m) for m in req.messages] if echo is not None else req.messages

        def plan_of(session: Session) -> Plan:
            try:
                plan = session.plan(self.chat, messages, req.tools, echo)
            except NotTokenExact as e:
                raise EndpointError(400, str(e), param=f"messages[{e.index}]") from None
            except Exception as e:  # the template refused the messages (a role it does not know)
                raise EndpointError(
                    400, f"messages: the chat template cannot render them ({str(e)[:500]})", param="messages"
                ) from None
            if not plan.went_on and session.segments:
                log.info("session %s: its messages do not extend its last turn; a new segment starts", session.id)
            self.limits.first_prompt(plan, "messages")
            return plan

        def choice(i: int, c: Choice, prompt: list[int]) -> dict:
            message: dict = {"role": "assistant", "content": c.text}
            if c.tool_calls:
                message = {"role": "assistant", "content": c.text or None, "tool_calls": c.tool_calls}
            message.update(token_fields(prompt, c))
            return {
                "index": i,
                "message": message,
                "finish_reason": c.finish_reason,
                "logprobs": {"content": token_logprobs(self.tok, c)} if req.logprobs else None,
            }

        return self._answer(req, session_id, cancel, plan_of, "chat.completion", "chatcmpl", choice, bool(req.tools))

    def completion(
        self, req: CompletionRequest, session_id: str | None, cancel: Cancel | None = None
    ) -> tuple[dict, Session, int]:
        if isinstance(req.prompt, list):
            ids = list(req.prompt)
            bad = next((t for t in ids if t >= self.limits.vocab_size), None)
            if bad is not None:
                raise EndpointError(
                    400, f"prompt: token id {bad} outside the vocabulary [0, {self.limits.vocab_size})", param="prompt"
                )
        else:
            if self.prompt_length is not None:
                self.limits.text(req.prompt, "prompt", self.prompt_length, f"prompt_length={self.prompt_length}")
            # as the trainer tokenises a prompt: its special tokens too (none for an empty text)
            ids = list(self.tok(req.prompt)["input_ids"]) if req.prompt else []
        if not ids:
            raise EndpointError(400, "prompt: empty", param="prompt")

        def plan_of(session: Session) -> Plan:
            plan = session.plan_raw(ids)
            self.limits.first_prompt(plan, "prompt")
            return plan

        def choice(i: int, c: Choice, prompt: list[int]) -> dict:
            logprobs = {"tokens": [self.tok.decode([t]) for t in c.ids], "token_logprobs": c.log_probs}
            return {
                "index": i,
                "text": c.text,
                "finish_reason": c.finish_reason,
                "logprobs": logprobs if req.logprobs else None,
                **token_fields(prompt, c),
            }

        return self._answer(req, session_id, cancel, plan_of, "text_completion", "cmpl", choice)

    def _answer(
        self,
        req: TurnRequest,
        session_id: str | None,
        cancel: Cancel | None,
        plan_of,
        kind: str,
        prefix: str,
        choice,
        tools: bool = False,
    ):
        """One turn of a session: its prompt (`plan_of(session)`), sampled, cut at the stop
        strings, then recorded (a turn that fails changes nothing, and a session that a failed
        first turn would have started is not kept; nor does a turn whose client hung up:
        `cancel`); the answer's body (`choice(i, c, prompt)` shapes each choice), the session and
        the policy version that sampled it."""
        stops = self.limits.stops(req.stop)
        params = self._params(req, stops)
        sid = self.limits.session_id(session_id, "x-session-id") or self.limits.session_id(req.session_id)
        try:
            session = self.sessions.begin(sid)
        except Forgotten as e:
            raise EndpointError(410, forgotten_message(e), code=SESSION_EVICTED, param="session_id") from None
        if session is None:
            raise EndpointError(404, f"no session {sid!r} here (ended, or never opened)", code="session_not_found")
        with session.lock:
            try:
                prompt, choices, policy_version = self._turn(session, plan_of, params, stops, tools, cancel)
            finally:
                self.sessions.settle(session)  # a session a turn started is kept once it holds one
            self.sessions.resized(session)
        body = {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": req.model or self.model_name,
            "system_fingerprint": f"policy-v{policy_version}",
            "session_id": session.id,
            "choices": [choice(i, c, prompt) for i, c in enumerate(choices)],
            "usage": usage(prompt, choices),
        }
        return body, session, policy_version

    def _turn(
        self, session: Session, plan_of, params: SamplingParams, stops: list[str], tools: bool, cancel: Cancel | None
    ):
        """The turn inside its session's lock: the session's budget checked, the prompt planned,
        sampled and applied to the session. (prompt, choices, the policy version that sampled them)."""
        if self.sessions.over_limit(session):
            raise EndpointError(
                400,
                f"session {session.id}: it holds {session.bytes} bytes, more than max_session_bytes="
                f"{self.sessions.max_session_bytes}; end it (DELETE /v1/sessions/{{id}}) or start another",
                code=SESSION_TOO_LARGE,
                param="session_id",
            )
        plan = plan_of(session)
        prompt = plan.ids
        if self.max_turns is not None and plan.turn > self.max_turns:
            raise EndpointError(
                400,
                f"session {session.id}: turn {plan.turn}, more than this endpoint's max_turns={self.max_turns}",
                code=MAX_TURNS_EXCEEDED,
            )
        room = self.max_tokens - (len(prompt) - plan.first)  # the session's budget: response_length
        if room < 1:
            raise EndpointError(
                400,
                f"session {session.id}: its conversation after the first prompt is {len(prompt) - plan.first} "
                f"tokens, no room for another reply in response_length={self.max_tokens} (what the learner "
                "trains on); end the session",
                code=CONTEXT_LENGTH_EXCEEDED,
            )
        params = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, room))
        self.limits.cost(params.n, len(prompt), params.max_new_tokens)
        try:
            result = self.sampler.generate(session, prompt, params, plan.first, cancel)
        except Abandoned:
            raise EndpointError(
                499, "the client closed the connection; the turn was cancelled", code="client_closed"
            ) from None
        except EndpointError as e:
            if e.status in (429, 503):  # an outage its agent may report as its own failure
                session.unavailable = True
            raise
        choices = self._choices(result.completions[0], result.policy_version, stops, tools)
        session.apply(plan, choices)
        return prompt, choices, result.policy_version

    def _params(self, req: TurnRequest, stops: list[str]) -> SamplingParams:
        if req.n > self.max_n:
            raise EndpointError(400, f"n: {req.n}, more than this server's {self.max_n}", param="n")
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
                k = first_with_stop(self.tok, ids, stops)
                ids, log_probs = ids[:k], log_probs[:k]
            choice = Choice(ids, log_probs, text, reason, policy_version)
            if tools:  # the request offered tools: calls written in the reply come back as tool_calls
                content, calls = parse_tool_calls(text)
                if calls:
                    choice.text, choice.tool_calls, choice.finish_reason = content, calls, "tool_calls"
            out.append(choice)
        return out


def forgotten_message(e: Forgotten) -> str:
    why = {
        "idle": "idle past session_ttl_s",
        "count": "past max_sessions",
        "bytes": "past max_sessions_bytes",
    }.get(e.why, e.why)
    return (
        f"session {e.session_id!r} was forgotten ({why}): its earlier turns are gone, so a turn now could not "
        "be trained with them token-exactly; start the conversation again under a new session id"
    )


def first_with_stop(tok, ids: list[int], stops: list[str]) -> int:
    """The fewest leading tokens of `ids` whose text holds a stop string (a longer prefix holds
    it too: found by halving, log2(len) decodes)."""
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        text = tok.decode(ids[:mid], skip_special_tokens=True)
        if any(s in text for s in stops):
            hi = mid
        else:
            lo = mid + 1
    return lo


def token_logprobs(tok, choice: Choice) -> list[dict]:
    """A chat choice's `logprobs.content`: each sampled token, its log-prob and bytes."""
    out = []
    for t, lp in zip(choice.ids, choice.log_probs):
        token = tok.decode([t])
        out.append({"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": []})
    return out


def token_fields(prompt: list[int], c: Choice) -> dict:
    """NeMo Gym's token fields of a choice (`TOKEN_FIELDS`): the prompt the policy saw, the ids
    it sampled (as kept: a stop string cuts them) and their log-probs."""
    return {"prompt_token_ids": prompt, "generation_token_ids": c.ids, "generation_log_probs": c.log_probs}


def usage(prompt: list[int], choices: list[Choice]) -> dict:
    completion = sum(len(c.ids) for c in choices)
    return {"prompt_tokens": len(prompt), "completion_tokens": completion, "total_tokens": len(prompt) + completion}
