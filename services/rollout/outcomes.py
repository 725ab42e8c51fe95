"""What a failed try at sampling a batch means, and what the rollout worker does about it: one
table, `TABLE`, read top to bottom; the first row that matches the error decides.

    an error (a failed gRPC call: its status code, its `Reason`, the service that answered;
    or an exception's type) -> an `Outcome` (what it means) -> `Then` (what the worker does),
    and for another try the `Fault` (common/servers.py: how long that generation server is avoided)

An error no row matches is no failure the worker knows: it propagates (the claim loop logs it and
goes on; the prompts stay pending).

The failures, by where they come from:
    a generation server unavailable, or refusing the request as a whole (its limits differ)
        -> another server is tried (that one avoided for a while); after `rollout.retries`
           the batch is left pending and picked up again later
    a Generate past its deadline -> retried like the above, with twice the deadline
    the reward or critic server unavailable -> wait for it (it restarts), as the learner does;
        so too while the user's reward API is down (its circuit breaker open) or refuses the
        token or URL: nothing is scored, nothing dropped
    the reward API failed this batch (its requests' retries spent, the breaker closed)
        -> the batch's scoring alone is repeated `reward.group_retries` times, then the batch is
           split and each prompt sampled and scored once more; a group that still gets no reward
           while the API scores others is dropped: dead-lettered (the learner feeds a
           replacement) and counted (`rlhf_rollout_groups_dropped_total`); when it scores none,
           the prompts stay pending (an outage, not an input). A batch of one prompt is dropped
           after its retries. No group is ever appended with a partial or a default reward.
    one prompt refused (INVALID_ARGUMENT about prompts[i], a reward rule's complaint, a 4xx the
        reward API answered about the input)
        -> the batch is split to find it; that prompt alone goes to the dead-letter stream
    the user's reward function raised -> the worker stops, and `rlhf up` stops the run (the
        prompts stay pending)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import grpc

from ..common.rpc.errors import Reason, reason_of
from ..common.rpc.retry import DependencyUnavailable
from ..common.servers import Fault
from ..training.sampling import Then


class ScoringFailed(RuntimeError):
    """The reward API failed a batch on every try: its groups have no reward."""


class Outcome(enum.Enum):
    """What a failed try at a batch means."""

    REWARD_FUNCTION_FAILED = enum.auto()  # the user's reward function raised (the details: its traceback)
    PROMPT_REFUSED = enum.auto()  # a prompt breaks a contract (a server's, or the worker's prompt_length)
    OTHER_SERVER_FAILED = enum.auto()  # the reward or critic server failed the try
    REQUEST_REFUSED = enum.auto()  # a generation server refuses the request as a whole (its limits differ)
    PAST_DEADLINE = enum.auto()  # a generation server was slower than the Generate deadline
    SERVER_FAILED = enum.auto()  # a generation server failed the call (unavailable, gone, ...)
    DEPENDENCY_GONE = enum.auto()  # the reward or critic server gone longer than the worker waits
    UNSCORED = enum.auto()  # the reward API failed the batch on every try (`ScoringFailed`)


@dataclass(frozen=True)
class Rpc:
    """A failed gRPC call, each of these that is not None as given: its status code, its
    `Reason`, and whether a generation server answered it (else the reward or critic server, which
    the worker's clients tag: `e.service`)."""

    code: grpc.StatusCode | None = None
    reason: Reason | None = None
    generation: bool | None = None

    def matches(self, e: BaseException) -> bool:
        if not isinstance(e, grpc.RpcError):
            return False
        seen = (e.code(), reason_of(e), getattr(e, "service", "generation") == "generation")
        return all(want is None or want == got for want, got in zip((self.code, self.reason, self.generation), seen))


@dataclass(frozen=True)
class Raised:
    """An exception of this type (or a subclass)."""

    type: type[BaseException]

    def matches(self, e: BaseException) -> bool:
        return isinstance(e, self.type)


@dataclass(frozen=True)
class Row:
    """One row of the table: an error that matches `when` means `outcome`, and the worker does
    `then`. A row that tries again, and only such a row, has a `fault`: what the failure says
    about the generation server. `counted`: the error is counted in rlhf_rollout_errors_total
    (its kind: `error_kind`); one that is not counts as what the worker makes of it (a dead
    letter, a dropped group), or stops the worker."""

    when: Rpc | Raised
    outcome: Outcome
    then: Then
    fault: Fault | None = None
    counted: bool = True

    def __post_init__(self):
        if (self.fault is not None) != self.tries_again:
            raise ValueError(f"{self}: a row that tries again, and only such a row, has a fault")

    @property
    def tries_again(self) -> bool:
        return self.then in (Then.RETRY, Then.RETRY_LONGER)


INVALID, DEADLINE = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED

# fmt: off
TABLE: tuple[Row, ...] = (
    #   the error                                    what it means                   what the worker does
    Row(Rpc(reason=Reason.REWARD_FUNCTION_FAILED),   Outcome.REWARD_FUNCTION_FAILED, Then.STOP, counted=False),
    Row(Rpc(INVALID, generation=False),              Outcome.PROMPT_REFUSED,         Then.DEAD_LETTER, counted=False),
    Row(Rpc(INVALID, reason=Reason.PROMPT_INVALID),  Outcome.PROMPT_REFUSED,         Then.DEAD_LETTER, counted=False),
    Row(Rpc(generation=False),                       Outcome.OTHER_SERVER_FAILED,    Then.RETRY, Fault.ELSEWHERE),
    Row(Rpc(INVALID),                                Outcome.REQUEST_REFUSED,        Then.RETRY, Fault.REFUSED),
    Row(Rpc(DEADLINE),                               Outcome.PAST_DEADLINE,          Then.RETRY_LONGER, Fault.FAILED),
    Row(Rpc(),                                       Outcome.SERVER_FAILED,          Then.RETRY, Fault.FAILED),
    Row(Raised(DependencyUnavailable),               Outcome.DEPENDENCY_GONE,        Then.LEAVE_PENDING),
    Row(Raised(ScoringFailed),                       Outcome.UNSCORED,               Then.DROP_UNSCORED, counted=False),
    Row(Raised(ValueError),                          Outcome.PROMPT_REFUSED,         Then.DEAD_LETTER, counted=False),
)
# fmt: on


def classify(e: BaseException) -> Row | None:
    """The first row of `TABLE` that `e` matches; None: no failure the worker knows."""
    return next((row for row in TABLE if row.when.matches(e)), None)


def error_kind(e: BaseException) -> str:
    """The kind a counted error adds to in rlhf_rollout_errors_total: a failed call's status code
    (lower case), else "dependency" (the reward or critic server gone past the wait)."""
    return e.code().name.lower() if isinstance(e, grpc.RpcError) else "dependency"


def message(e: BaseException) -> str:
    """What the error says, for the log and a dead letter: a failed call's details."""
    return str(e.details()) if isinstance(e, grpc.RpcError) else str(e)
