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
role, content, tool calls). The chat template is read as chat_tokens.py says; the sessions of an
endpoint are kept as session_store.py says.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..common.types import Completion
from .chat_tokens import ChatTokens, NotTokenExact
from .tools import same_calls

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
