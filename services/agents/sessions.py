"""Token-exact sessions: what the policy saw and sampled, turn by turn, whatever the agent sends.

A session is one rollout of an agent (a conversation). Its first request's messages go through the
model's chat template and the tokenizer; from then on a request whose messages extend the session
(the earlier messages unchanged, then the assistant message the server returned, then new messages:
tool results, user turns) keeps every token already in context as it was: the assistant turns are
the token ids the policy sampled, never re-tokenised from their text, and only the new messages are
tokenised (the template's text after the conversation so far). So the trajectory is

    prompt tokens (mask 0) + sampled tokens (mask 1) + environment tokens (mask 0) + sampled ...

and each sampled token keeps its log-prob and the policy version that sampled it.

A request that does not extend the session (the agent rewrote its history, or chose none of the
returned choices) starts a new segment: the earlier one is kept as it was, and the new one is
tokenised afresh. With `n` > 1 each choice is a branch: until the next request, the record lists
each as its own trajectory; the next request's assistant message says which one the session goes
on with, and the others are dropped.

NeMo Gym's token fields. Every choice the gateway returns carries, on its message,
`prompt_token_ids` (the prompt the policy saw), `generation_token_ids` (what it sampled) and
`generation_log_probs` (their log-probs) (`TOKEN_FIELDS`). A request whose assistant message
carries them back (`Echo`: the last such message) goes on from those tokens, not from the
template's rendering of the conversation before it: when they are the session's own pending turn
(its prompt and one of its choices, token for token) the session goes on in its segment as above;
otherwise (a client without a session, a new session built from another's trajectory, tokens the
session did not sample) a new segment starts whose context is the echoed tokens, all of them
with mask 0: a trajectory's mask is 1 only on what the gateway sampled in that session.

What a session holds is counted in bytes (`Session.bytes`: about `TOKEN_BYTES` a token position,
its messages' strings at their size; a segment keeps of each message only what it compares:
role, content, tool calls). `Sessions` forgets the longest idle ones past a count, past a total
of bytes, and after their time to live.
"""

from __future__ import annotations

import sys
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ..common.types import Completion
from .tools import same_calls

MARK = "\u2063rlhf-assistant-content\u2063"  # stands in for an assistant turn's content when reading the template
TOKEN_BYTES = 80  # one token position of a record in Python lists: its id, mask, log-prob (slots and objects)
SESSION_BYTES = 1024  # a session's own fields, besides its id and its segments
KEPT = ("role", "content", "tool_calls")  # what a segment keeps of a message: what `same_message` compares
# NeMo Gym's names (nemo_gym/openai_utils.py: TokenIDLogProbMixin), on each returned choice's
# message and on an assistant message sent back
TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


def size_of(obj: Any) -> int:
    """About the bytes a JSON-like value (dicts, lists, strings, numbers) holds in Python."""
    total, stack = 0, [obj]
    while stack:
        o = stack.pop()
        total += sys.getsizeof(o)
        if isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
    return total


def kept(message: dict) -> dict:
    """What a segment keeps of a message (the fields the template renders but `same_message`
    does not compare, and anything else a client sent, are not kept)."""
    return {k: message[k] for k in KEPT if k in message}


@dataclass
class Choice:
    """One sampled completion of a turn: its tokens as kept (a stop string cuts them), their
    log-probs, the text returned for them, why it ended, and the policy version that sampled it."""

    ids: list[int]
    log_probs: list[float]
    text: str
    finish_reason: str
    policy_version: int
    tool_calls: list[dict] = field(default_factory=list)  # parsed out of the text (tools.py)

    def size(self) -> int:
        return TOKEN_BYTES * len(self.ids) + size_of(self.text) + size_of(self.tool_calls)

    def answers(self, message: dict) -> bool:
        """Whether `message` is this choice as the gateway returned it (an agent echoes it back)."""
        return (
            message.get("role") == "assistant"
            and (message.get("content") or "") == self.text
            and same_calls(message.get("tool_calls"), self.tool_calls)
        )


@dataclass
class Segment:
    """A token-exact trajectory: `ids` (every token in context), `mask` (1 where the policy
    sampled the token), `log_probs` (the sampled tokens'; 0.0 elsewhere), `policy_versions` (the policy
    version of each sampled turn), and the `messages` those tokens are."""

    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    pending: list[Choice] = field(default_factory=list)  # the last turn's choices, not yet taken
    first: int = 0  # how many of `ids` are its conversation's first prompt (the rest: response_length)

    def size(self) -> int:
        """About the bytes this segment holds (`TOKEN_BYTES` a token position, its messages,
        its pending choices)."""
        return (
            TOKEN_BYTES * len(self.ids)
            + 8 * len(self.policy_versions)
            + size_of(self.messages)
            + sum(c.size() for c in self.pending)
        )

    def extend(self, ids: list[int], sampled: bool, log_probs: list[float] | None = None) -> None:
        self.ids += ids
        self.mask += [int(sampled)] * len(ids)
        self.log_probs += list(log_probs) if log_probs is not None else [0.0] * len(ids)

    def trajectories(self) -> list[dict]:
        """What a trainer reads: this segment once per pending choice (each its own branch), or
        once as it stands when no turn is pending."""
        if not self.pending:
            return [self._as_dict(self.ids, self.mask, self.log_probs, self.policy_versions, None)]
        return [
            self._as_dict(
                self.ids + c.ids,
                self.mask + [1] * len(c.ids),
                self.log_probs + c.log_probs,
                self.policy_versions + [c.policy_version],
                c.finish_reason,
            )
            for c in self.pending
        ]

    @staticmethod
    def _as_dict(ids, mask, log_probs, policy_versions, finish_reason) -> dict:
        return {
            "token_ids": list(ids),
            "loss_mask": list(mask),
            "log_probs": list(log_probs),
            "policy_versions": list(policy_versions),
            "turns": len(policy_versions),
            "finish_reason": finish_reason,
        }


def as_sample(trajectory: dict) -> tuple[list[int], Completion]:
    """A session's trajectory (`Segment.trajectories`) as the trainer takes a sample: the prompt
    (the tokens before the policy's first) and a completion of the rest, whose loss mask keeps
    the environment's tokens out of the loss (`Rollout.loss_masks`) and whose `token_versions`
    say which version sampled each turn, when the turns' versions differ."""
    ids, mask, log_probs = trajectory["token_ids"], trajectory["loss_mask"], trajectory["log_probs"]
    start = mask.index(1) if 1 in mask else len(mask)
    versions = turn_versions(mask[start:], trajectory["policy_versions"])
    completion = Completion(
        ids[start:], log_probs[start:], trajectory["finish_reason"] or "length", mask[start:], versions
    )
    return ids[:start], completion


def turn_versions(mask: list[int], versions: list[int]) -> list[int] | None:
    """Per token, the version of the turn it belongs to: each run of sampled tokens (1s of `mask`)
    is one turn, in order; the environment's tokens after a turn carry its version (they are out
    of the loss). None when every turn has one version (or the runs do not match the turns)."""
    starts = [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]
    if len(set(versions)) <= 1 or len(starts) != len(versions):
        return None
    out, turn = [], 0
    for i in range(len(mask)):
        if turn + 1 < len(starts) and i == starts[turn + 1]:
            turn += 1
        out.append(versions[turn])
    return out


class ChatTokens:
    """The chat template and the tokenizer of the served model, read the way a session needs
    them: the prompt of a new conversation, and the tokens of the messages that extend one."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "the model's tokenizer has no chat template: /v1/chat/completions needs one "
                "(tokenizer_config.json's chat_template, or chat_template.jinja in the model directory)"
            )
        probe = self.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": MARK}], False)
        self.closing = probe[probe.index(MARK) + len(MARK) :]  # what the template puts after an assistant turn
        eos = tokenizer.eos_token_id
        self.eos_text = tokenizer.decode([eos]) if eos is not None else ""

    def render(self, messages: list[dict], add_generation_prompt: bool, tools: list | None = None) -> str:
        return self.tok.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def prompt(self, messages: list[dict], tools: list | None = None) -> list[int]:
        """A new conversation's prompt: the template with the generation prompt, tokenised once."""
        return self.encode(self.render(messages, True, tools))

    def continuation(
        self, before: list[dict], after: list[dict], last: Choice, tools: list | None = None
    ) -> list[int] | None:
        """The tokens that follow the sampled turn `last` (the last message of `before`) when the
        conversation goes on with `after`: the rest of the template's closing of that turn (its end
        of turn, unless the policy sampled it), then `after` as the template renders it, up to the
        next generation prompt. None when the template does not render `before` as a prefix of
        `before + after` (then the session cannot go on token-exact)."""
        head = self.render(before, False, tools)
        full = self.render(before + after, True, tools)
        if not full.startswith(head) or not head.endswith(self.closing):
            return None
        closing = self.closing
        sampled_eos = bool(last.ids) and last.ids[-1] == self.tok.eos_token_id
        if sampled_eos and self.eos_text and closing.startswith(self.eos_text):
            closing = closing[len(self.eos_text) :]  # the policy sampled the end of its turn itself
        return self.encode(closing + full[len(head) :])


class NotTokenExact(ValueError):
    """Echoed token fields that the session cannot go on from: the chat template renders the
    conversation before the echoed message differently once more messages follow it."""

    def __init__(self, index: int):
        super().__init__(
            f"messages[{index}]: the chat template does not render the conversation up to this assistant "
            "message as a prefix of the whole, so the next prompt cannot go on from its token ids"
        )
        self.index = index


@dataclass
class Echo:
    """The token fields an assistant message of a request carries back (`TOKEN_FIELDS`, checked
    by the gateway): the last such message's `index`, its `prompt` and `generation` token ids and
    their `log_probs`, and `first`: how many tokens of the conversation are its first prompt (the
    earliest echoed message's prompt, when the later prompts go on from it; else this one's)."""

    index: int
    prompt: list[int]
    generation: list[int]
    log_probs: list[float]
    first: int


def without_token_fields(message: dict) -> dict:
    """`message` without `TOKEN_FIELDS` (what the chat template is given)."""
    if not any(k in message for k in TOKEN_FIELDS):
        return message
    return {k: v for k, v in message.items() if k not in TOKEN_FIELDS}


def same_message(a: dict, b: dict) -> bool:
    """Two messages are the same turn: role, content and tool calls (as an agent echoes them)."""
    return (
        a.get("role") == b.get("role")
        and (a.get("content") or "") == (b.get("content") or "")
        and same_calls(a.get("tool_calls"), b.get("tool_calls"))
    )


@dataclass
class Session:
    id: str
    segments: list[Segment] = field(default_factory=list)
    server: str | None = None  # the generation server its requests go to while it lives
    used: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)  # one request of a session at a time
    reward: float | None = None  # what its agent posted (POST /v1/sessions/{id}/reward)
    min_version: int = 0  # the policy version its turns should come from (a server at it is preferred)
    unavailable: bool = False  # a turn found no generation server (503) or a full one (429)
    bytes: int = 0  # about what it holds (`size`), as of its last turn
    counted: int = 0  # what its `Sessions` counts it at

    def __post_init__(self) -> None:
        self.bytes = self.size()

    def size(self) -> int:
        return SESSION_BYTES + len(self.id) + sum(seg.size() for seg in self.segments)

    def plan(
        self, chat: ChatTokens, messages: list[dict], tools: list | None = None, echo: Echo | None = None
    ) -> "Plan":
        """The prompt of a request with `messages`, and what it does to the session once its turn
        is sampled (`apply`): the taken choice and the new messages' tokens appended to the
        last segment (it went on token-exact), else a new segment. Nothing changes until then, so
        a request that fails (no server answered) can be sent again as it was. `echo`: the token
        fields an assistant message carries back (`plan_echoed`)."""
        if echo is not None:
            return self.plan_echoed(chat, messages, tools, echo)
        seg = self.segments[-1] if self.segments else None
        if seg is not None and seg.pending:
            n = len(seg.messages)
            if len(messages) > n + 1 and all(same_message(a, b) for a, b in zip(messages[:n], seg.messages)):
                taken = next((c for c in seg.pending if c.answers(messages[n])), None)
                if taken is not None:
                    # the sampled tokens stay as they are (tool-call blocks too); the reply is
                    # rendered as plain content (no tool_calls: the template would write them
                    # again) and only what the template puts after it is taken
                    said = {"role": "assistant", "content": taken.text}
                    rest = chat.continuation(messages[:n] + [said], messages[n + 1 :], taken, tools)
                    if rest is not None:
                        return Plan(seg.ids + taken.ids + rest, messages, seg.first, seg, taken, rest)
        ids = chat.prompt(messages, tools)
        return Plan(ids, messages, len(ids))

    def plan_echoed(self, chat: ChatTokens, messages: list[dict], tools: list | None, echo: Echo) -> "Plan":
        """The prompt of a request whose assistant message `messages[echo.index]` carries token
        fields back: those tokens, then the template's tokens of the messages after it (as
        `ChatTokens.continuation` reads them). The session's own pending turn (the echoed prompt
        is its segment's tokens and the echoed generation one of its choices) goes on in its
        segment; any other echo starts a new segment whose context is the echoed tokens (mask 0).
        NotTokenExact when the template does not let the conversation go on from them."""
        k = echo.index
        content = messages[k].get("content")
        seg = self.segments[-1] if self.segments else None
        if seg is not None and seg.pending and echo.prompt == seg.ids:
            taken = next((c for c in seg.pending if c.ids == echo.generation), None)
            if taken is not None:
                said = {"role": "assistant", "content": taken.text}
                rest = chat.continuation(messages[:k] + [said], messages[k + 1 :], taken, tools)
                if rest is None:
                    raise NotTokenExact(k)
                return Plan(seg.ids + taken.ids + rest, messages, seg.first, seg, taken, rest)
        said = {"role": "assistant", "content": content if isinstance(content, str) else ""}
        last = Choice(echo.generation, echo.log_probs, said["content"], "stop", 0)
        rest = chat.continuation(messages[:k] + [said], messages[k + 1 :], last, tools)
        if rest is None:
            raise NotTokenExact(k)
        return Plan(echo.prompt + echo.generation + rest, messages, min(echo.first, len(echo.prompt)))

    def plan_raw(self, prompt: list[int]) -> "Plan":
        """A raw prompt (/v1/completions): a new segment of exactly these tokens."""
        return Plan(list(prompt), [], len(prompt))

    def apply(self, plan: Plan, choices: list[Choice]) -> None:
        """A request's turn was sampled: record what it took (`plan`) and its `choices` (pending
        until the next request says which one the session goes on with)."""
        seg = plan.segment
        if seg is None:
            seg = Segment(messages=[kept(m) for m in plan.messages], first=plan.first)
            seg.extend(plan.ids, False)
            self.segments.append(seg)
        else:
            assert plan.taken is not None
            seg.extend(plan.taken.ids, True, plan.taken.log_probs)
            seg.policy_versions.append(plan.taken.policy_version)
            seg.extend(plan.rest, False)
            seg.messages = [kept(m) for m in plan.messages]
        seg.pending = choices
        self.bytes = self.size()

    def set_reward(self, reward: float) -> None:
        with self.lock:
            self.reward = reward

    def record(self) -> dict[str, Any]:
        with self.lock:
            return self._record()

    def _record(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "server": self.server,
            "reward": self.reward,
            "unscored": self.reward is None,  # no reward posted: never read as 0
            "trajectories": [t for seg in self.segments for t in seg.trajectories()],
        }


@dataclass
class Plan:
    """One request's prompt (`ids`) and what its sampled turn changes in its session
    (`Session.apply`): the segment it goes on (None: a new one), the last turn's choice its
    messages took, and the environment's tokens after it. `first`: how many of `ids` are the
    conversation's first prompt (the rest count against response_length)."""

    ids: list[int]
    messages: list[dict]
    first: int
    segment: Segment | None = None
    taken: Choice | None = None
    rest: list[int] = field(default_factory=list)

    @property
    def went_on(self) -> bool:
        return self.segment is not None

    @property
    def turn(self) -> int:
        """Which sampled turn of its segment this request's is (1: the first)."""
        return len(self.segment.policy_versions) + 2 if self.segment is not None else 1


class Forgotten(LookupError):
    """A turn names a session this endpoint forgot (`why`: one of `Sessions.EVICTIONS`): its
    earlier turns are gone, so the turn cannot go on from them token-exactly."""

    def __init__(self, session_id: str, why: str):
        super().__init__(session_id, why)
        self.session_id, self.why = session_id, why


class Sessions:
    """The gateway's sessions by id, each forgotten after `ttl_s` idle; at most `limit` of them
    and, with `max_bytes`, at most that many bytes of them all (`Session.bytes`): the longest
    idle goes first. `max_session_bytes`: what one session may hold before its next turn is
    refused (the gateway asks `over_limit`). A forgotten session's id is remembered for `ttl_s`
    (the newest `limit` of them): a turn naming it is refused (`Forgotten`), not started afresh
    as a session whose record would lack the turns before."""

    EVICTIONS = ("idle", "count", "bytes")  # why a session was forgotten (`evicted`)

    def __init__(
        self,
        ttl_s: float = 3600.0,
        limit: int = 10_000,
        create_unknown: bool = True,
        max_bytes: int | None = None,
        max_session_bytes: int | None = None,
    ):
        """`create_unknown`: a request naming an unknown session starts it (the endpoint for any
        client); False: only `open` starts one (a rollout worker's own endpoint, whose sessions
        the worker opens and ends: a late request of an ended one is refused)."""
        self.ttl_s, self.limit, self.create_unknown = ttl_s, limit, create_unknown
        self.max_bytes, self.max_session_bytes = max_bytes, max_session_bytes
        self._by_id: OrderedDict[str, Session] = OrderedDict()  # the longest idle first
        # new sessions no turn has succeeded in yet, each with its turns in flight
        self._pending: dict[str, tuple[Session, int]] = {}
        self._forgotten: OrderedDict[str, tuple[str, float]] = OrderedDict()  # id: (why, when), oldest first
        self._lock = threading.Lock()
        self.bytes = 0  # what the sessions hold together (each as of its last turn)
        self.evicted = dict.fromkeys(self.EVICTIONS, 0)

    def get(self, session_id: str | None, create: bool | None = None) -> Session | None:
        """The session `session_id` names; an unknown one is started (a fresh id when None) if
        `create` (default `create_unknown`), else None."""
        create = self.create_unknown if create is None else create
        now = time.monotonic()
        with self._lock:
            while self._by_id and now - next(iter(self._by_id.values())).used > self.ttl_s:
                self._drop(next(iter(self._by_id)), "idle")
            sid = session_id or uuid.uuid4().hex
            session = self._by_id.get(sid)
            if session is None:
                if not create:
                    return None
                session = Session(sid)
                self._admit(session)
            session.used = now
            self._by_id.move_to_end(sid)
            return session

    def begin(self, session_id: str | None) -> Session | None:
        """The session a turn is for: the one `session_id` names, or, for an unknown one (a fresh
        id when None) when `create_unknown`, a new session that is not kept, counted or let evict
        another until a turn of it succeeds (`settle`); None for an unknown one otherwise. Turns of
        one new id at once share its new session. A forgotten one: `Forgotten`."""
        if not self.create_unknown:
            return self.get(session_id)
        sid = session_id or uuid.uuid4().hex
        with self._lock:
            found = self._by_id.get(sid)
            if found is not None:
                found.used = time.monotonic()
                self._by_id.move_to_end(sid)
                return found
            self._forget_expired()
            if sid in self._forgotten:
                raise Forgotten(sid, self._forgotten[sid][0])
            new, turns = self._pending.get(sid, (None, 0))
            new = new or Session(sid)
            self._pending[sid] = (new, turns + 1)
            return new

    def settle(self, session: Session) -> None:
        """After a turn of `session` (taken or refused), under its lock: a new session that holds a
        turn now is kept (counted, evicting as `get` does); one whose turns all failed is forgotten
        once none is in flight."""
        with self._lock:
            new, turns = self._pending.get(session.id, (None, 0))
            if new is not session:
                return
            if session.segments:
                del self._pending[session.id]
                self._admit(session)
            elif turns <= 1:
                del self._pending[session.id]
            else:
                self._pending[session.id] = (session, turns - 1)

    def _admit(self, session: Session) -> None:
        """Keep `session` (under the lock): the longest idle ones forgotten past the count and the bytes."""
        while len(self._by_id) >= self.limit:
            self._drop(next(iter(self._by_id)), "count")
        self._by_id[session.id] = session
        session.counted = session.bytes
        self.bytes += session.counted
        self._evict_bytes(session.id)
        session.used = time.monotonic()

    def open(self, session_id: str, min_version: int = 0) -> Session:
        """A session of this id (new, or the one there), its turns preferring servers at `min_version`."""
        session = self.get(session_id, create=True)
        assert session is not None
        session.min_version = min_version
        return session

    def over_limit(self, session: Session) -> bool:
        """Whether `session` holds more than `max_session_bytes` (its next turn is refused)."""
        return self.max_session_bytes is not None and session.bytes > self.max_session_bytes

    def resized(self, session: Session) -> None:
        """`session` had a turn (`Session.apply`): count what it holds now, and forget the longest
        idle others while all of them hold more than `max_bytes`."""
        with self._lock:
            if self._by_id.get(session.id) is not session:
                return  # ended or forgotten while its turn was sampled
            self.bytes += session.bytes - session.counted
            session.counted = session.bytes
            self._evict_bytes(session.id)

    def _evict_bytes(self, keep: str) -> None:
        if self.max_bytes is None:
            return
        while self.bytes > self.max_bytes and len(self._by_id) > 1:
            oldest = next(iter(self._by_id))
            if oldest == keep:  # the session in use stays
                oldest = next(s for s in self._by_id if s != keep)
            self._drop(oldest, "bytes")

    def _drop(self, sid: str, why: str) -> None:
        session = self._by_id.pop(sid)
        self.bytes -= session.counted
        self.evicted[why] += 1
        self._forgotten[sid] = (why, time.monotonic())
        while len(self._forgotten) > self.limit:
            self._forgotten.popitem(last=False)

    def _forget_expired(self) -> None:
        """The forgotten ids remembered past `ttl_s` let go (a turn naming one starts it afresh)."""
        now = time.monotonic()
        while self._forgotten and now - next(iter(self._forgotten.values()))[1] > self.ttl_s:
            self._forgotten.popitem(last=False)

    def find(self, session_id: str) -> Session | None:
        with self._lock:
            return self._by_id.get(session_id)

    def end(self, session_id: str) -> Session | None:
        with self._lock:
            session = self._by_id.pop(session_id, None)
            if session is not None:
                self.bytes -= session.counted
            return session

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_id)
