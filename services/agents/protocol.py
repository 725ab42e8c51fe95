"""The agents' OpenAI-compatible endpoint, its protocol: what a request may hold and what an answer
says when it is refused. The request models (`ChatRequest`, `CompletionRequest`, `RewardPost`),
the error codes a client acts on, `EndpointError` (OpenAI's error shape), and `Limits`: every check
of a request's values against the endpoint's bounds, made before any work that grows with them
(the text's length before it is tokenised, token ids within the vocabulary, a session id that can
travel in a header, the token fields an assistant message carries back).

The endpoint is three modules, as vLLM's entrypoints are: this protocol, the handler (handler.py:
one turn, its session, its sampling, its record; turns.py: which generation server samples it) and
the routes (routes.py: the ASGI app, its auth and server-sent events). The gateway service
(`rlhf serve gateway`) and every rollout worker's endpoint (host.py) compose them."""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .sessions import TOKEN_FIELDS, Echo, Plan

SESSION_HEADER = "x-session-id"
POLICY_VERSION_HEADER = "x-policy-version"
INT64 = 2**63  # a seed is an int64 on the wire (generation.proto)
INT32 = 2**31  # a token id is an int32 on the wire
# printable ASCII, no space at either end (an HTTP header value cannot begin or end with one): it
# goes back in the x-session-id header of the answer
SESSION_ID = re.compile(r"(?:[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?)?")
MAX_PROMPT_TOKENS = 1 << 17  # echoed prompts' bound without prompt_length (the generation server bounds its own)


class TurnRequest(BaseModel):
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

    @field_validator("top_p")
    @classmethod
    def _top_p_on_the_wire(cls, top_p: float) -> float:
        # the wire carries a float32: a top_p that rounds to 0 there would be refused as 0.0
        if struct.unpack("<f", struct.pack("<f", top_p))[0] == 0.0:
            raise ValueError(f"{top_p:g} rounds to 0 as the float32 the generation server is sent; at least 1e-38")
        return top_p


class ChatRequest(TurnRequest):
    messages: list[dict] = Field(min_length=1)
    tools: list[dict] | None = None


class CompletionRequest(TurnRequest):
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
SESSION_EVICTED = "session_evicted"  # a turn names a session the endpoint forgot (410)
BUDGET_SPENT = (CONTEXT_LENGTH_EXCEEDED, MAX_TURNS_EXCEEDED)


def budget_spent(error: Exception) -> bool:
    """Whether an `openai` client's error is the endpoint refusing a turn because its session's
    budget is spent (no room left in response_length, or max_turns turns): an episode ends there,
    truncated, with the rewards so far (every episode loop asks this)."""
    return getattr(error, "status_code", None) == 400 and getattr(error, "code", None) in BUDGET_SPENT


class EndpointError(Exception):
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


def text_chars(value: Any) -> int:
    """How many characters a JSON-like value can become as text (what a chat template may render
    of it): its strings' characters, and for every other value (a number, true, false, null) its
    own text and a separator: `[0] * 2500000` is 7.5 million characters, not none."""
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
        else:
            total += len(str(v)) + 2
    return total


def check_messages(messages: list) -> None:
    """Each message an object whose `content` is a string, null or a list of content parts
    (objects, as OpenAI's are), refused by its field otherwise, before a chat template sees it."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise EndpointError(400, f"messages[{i}]: {shown(m)}, not a message object", param=f"messages[{i}]")
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            if not isinstance(content, list) or not all(isinstance(part, dict) for part in content):
                raise EndpointError(
                    400,
                    f"messages[{i}].content: {shown(content)}, neither a string nor a list of content parts",
                    param=f"messages[{i}].content",
                )
        if m.get("tool_calls") is not None:
            _check_tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")


def _check_tool_calls(calls: Any, param: str) -> None:
    """OpenAI's shape of an assistant message's tool calls: a list of objects, each with a
    `function` object of a string `name` and string `arguments` (JSON text)."""
    if not isinstance(calls, list):
        raise EndpointError(400, f"{param}: {shown(calls)}, not a list of tool calls", param=param)
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise EndpointError(
                400, f"{param}[{j}]: {shown(call)}, not a tool call ({{function: {{name, arguments}}}})", param=param
            )
        if not isinstance(function.get("arguments", ""), str):
            raise EndpointError(
                400, f"{param}[{j}].function.arguments: {shown(function['arguments'])}, not JSON text", param=param
            )


def max_token_chars(tokenizer) -> int:
    """The most characters one token stands for (the longest entry of the vocabulary, added
    tokens included): n tokens are never more than n times this many characters of text."""
    try:
        vocab = tokenizer.get_vocab()
        return max(1, max((len(t) for t in vocab), default=1))
    except Exception:  # a tokenizer without a vocabulary to read: a bound no BPE vocabulary passes
        return 64


def shown(value: Any) -> str:
    """A value of a request in an error message, described, never echoed (an answer does not carry
    a request's content back): a number or a boolean as it is, else its JSON type and size."""
    if value is None or isinstance(value, (bool, int, float)):
        return json.dumps(value)
    if isinstance(value, str):
        return f"a string of {len(value)} characters"
    if isinstance(value, list):
        return f"a list of {len(value)} items"
    if isinstance(value, dict):
        return f"an object of {len(value)} keys"
    return type(value).__name__


@dataclass(frozen=True)
class Limits:
    """The endpoint's bounds on a request, and its checks against them (each an `EndpointError`
    400 naming the field). `vocab_size`: token ids are below it; `prompt_length`: the most tokens
    of a conversation's first prompt (None: the generation server says); `max_tokens`: a session's
    budget after its first prompt (response_length); `token_chars`: the most characters one token
    stands for (`max_token_chars`); `max_session_id_bytes`: the longest session id taken."""

    vocab_size: int
    prompt_length: int | None
    max_tokens: int
    token_chars: int
    max_session_id_bytes: int = 256
    max_request_tokens: int | None = None  # rpc.max_request_tokens: what one Generate may cost

    @property
    def max_context(self) -> int:
        """The most tokens echoed fields may hold: a conversation's first prompt and its response_length."""
        return (self.prompt_length if self.prompt_length is not None else MAX_PROMPT_TOKENS) + self.max_tokens

    def session_id(self, sid: str | None, param: str = "session_id") -> str | None:
        """`sid` if it is a session id this endpoint takes (printable ASCII, at most
        `max_session_id_bytes`), else EndpointError 400."""
        if sid is None:
            return None
        if len(sid) > self.max_session_id_bytes or not SESSION_ID.fullmatch(sid):
            raise EndpointError(
                400,
                f"{param}: a session id is 1 to {self.max_session_id_bytes} printable ASCII characters, "
                f"no space at either end (this one: {len(sid)} characters)",
                param=param,
            )
        return sid

    def stops(self, stop) -> list[str]:
        """The request's stop strings: at most 4, none empty, none longer than a whole reply can
        be (`max_tokens` tokens of the longest token's characters: a longer one never matches)."""
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not s for s in stops):
            raise EndpointError(400, "stop: an empty string", param="stop")
        if len(stops) > 4:
            raise EndpointError(400, f"stop: {len(stops)} sequences, at most 4", param="stop")
        longest = self.max_tokens * self.token_chars
        for s in stops:
            if len(s) > longest:
                raise EndpointError(
                    400,
                    f"stop: a stop string of {len(s)} characters, longer than a reply of response_length="
                    f"{self.max_tokens} tokens can be ({longest} characters)",
                    param="stop",
                )
        return stops

    def cost(self, n: int, prompt_tokens: int, max_new_tokens: int) -> None:
        """A turn that can never fit a Generate (n x (prompt + max_new_tokens) token positions over
        rpc.max_request_tokens): 400 naming the bound, not a "server full" to retry."""
        cost = n * (prompt_tokens + max_new_tokens)
        if self.max_request_tokens is not None and cost > self.max_request_tokens:
            raise EndpointError(
                400,
                f"n={n} x ({prompt_tokens} prompt tokens + max_tokens={max_new_tokens}) = {cost} token positions, "
                f"more than rpc.max_request_tokens={self.max_request_tokens}; ask for fewer samples or tokens",
                code="request_too_large",
                param="n",
            )

    def text(self, value: Any, param: str, tokens: int, bound: str) -> None:
        """Refuse text that cannot be `tokens` tokens or fewer (`bound` says which), before
        tokenising it: more characters than `tokens` times the longest token's."""
        chars = text_chars(value)
        if chars > tokens * self.token_chars:
            raise EndpointError(
                400,
                f"{param}: {chars} characters of text, more than {tokens} tokens can be ({bound})",
                code=CONTEXT_LENGTH_EXCEEDED,
                param=param,
            )

    def first_prompt(self, plan: Plan, param: str) -> None:
        if self.prompt_length is not None and plan.first > self.prompt_length:
            raise EndpointError(
                400,
                f"{param}: a first prompt of {plan.first} tokens, more than prompt_length={self.prompt_length}",
                code=CONTEXT_LENGTH_EXCEEDED,
                param=param,
            )

    def token_ids(self, value: Any, param: str, empty: bool) -> list[int]:
        if not isinstance(value, list):
            raise EndpointError(400, f"{param}: a list of token ids", param=param)
        if not value and not empty:
            raise EndpointError(400, f"{param}: empty", param=param)
        if len(value) > self.max_context:
            raise EndpointError(
                400,
                f"{param}: {len(value)} token ids, more than a conversation holds ({self.max_context})",
                code=CONTEXT_LENGTH_EXCEEDED,
                param=param,
            )
        for i, t in enumerate(value):
            if type(t) is not int or not 0 <= t < self.vocab_size:
                raise EndpointError(
                    400, f"{param}[{i}]: {shown(t)}, not a token id in [0, {self.vocab_size})", param=param
                )
        return value

    def echo(self, messages: list[dict]) -> Echo | None:
        """NeMo Gym's token fields on the request's assistant messages, each message's checked (all
        three or none; token ids within the vocabulary, finite log-probs, as many as the ids, at
        most `max_context` tokens together): the last such message's as an `Echo`, or None."""
        found = [(i, *self._echoed(i, m)) for i, m in enumerate(messages) if any(k in m for k in TOKEN_FIELDS)]
        if not found:
            return None
        k, prompt, generation, log_probs = found[-1]
        earliest = found[0][1]  # the conversation's first prompt, when the later ones go on from it
        first = len(earliest) if prompt[: len(earliest)] == earliest else len(prompt)
        return Echo(k, prompt, generation, log_probs, first)

    def _echoed(self, i: int, m: dict) -> tuple[list[int], list[int], list[float]]:
        """One message's token fields, checked: (prompt, generation, log-probs)."""
        at = f"messages[{i}]"
        present = [k for k in TOKEN_FIELDS if k in m]
        if m.get("role") != "assistant":
            raise EndpointError(
                400,
                f"{at}: {', '.join(present)} on a {shown(m.get('role'))} message (only an assistant "
                "message carries them back)",
                param=f"{at}.{present[0]}",
            )
        missing = [k for k in TOKEN_FIELDS if k not in m]
        if missing:
            raise EndpointError(
                400, f"{at}: {', '.join(missing)} missing (the three go together)", param=f"{at}.{missing[0]}"
            )
        prompt = self.token_ids(m["prompt_token_ids"], f"{at}.prompt_token_ids", empty=False)
        generation = self.token_ids(m["generation_token_ids"], f"{at}.generation_token_ids", empty=True)
        param = f"{at}.generation_log_probs"
        log_probs = m["generation_log_probs"]
        if not isinstance(log_probs, list):
            raise EndpointError(400, f"{param}: a list of numbers", param=param)
        for j, lp in enumerate(log_probs):
            if type(lp) not in (int, float) or not math.isfinite(lp):
                raise EndpointError(400, f"{param}[{j}]: {shown(lp)}, not a finite number", param=param)
        if len(log_probs) != len(generation):
            raise EndpointError(
                400, f"{param}: {len(log_probs)} log-probs for {len(generation)} generation_token_ids", param=param
            )
        if len(prompt) + len(generation) > self.max_context:
            raise EndpointError(
                400,
                f"{at}: {len(prompt) + len(generation)} tokens, more than a conversation holds ({self.max_context})",
                code=CONTEXT_LENGTH_EXCEEDED,
                param=f"{at}.prompt_token_ids",
            )
        return prompt, generation, [float(x) for x in log_probs]
