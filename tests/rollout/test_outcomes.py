"""The outcomes table (services/rollout/outcomes.py), row by row: what a failed try at a batch
means and what the worker does about it, for every kind of error it knows (a failed call by its
status code, its `Reason` and the service that answered; an exception by its type). The worker's
tests against real services (test_worker.py, test_reward_api_failures.py) show each in action."""

import grpc
import pytest

from services.common.rpc.errors import Reason, ServiceError, status_for
from services.common.rpc.retry import DependencyUnavailable
from services.common.servers import Fault
from services.rollout.outcomes import (
    TABLE,
    Outcome,
    Row,
    Rpc,
    ScoringFailed,
    Then,
    classify,
    error_kind,
    message,
)

INVALID, UNAVAILABLE = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE


class CallFailed(grpc.RpcError, grpc.Call):
    """A failed call as a client sees it: its status (with the `Reason` as error details) and,
    from another service than a generation server, the tag the worker's clients put on it."""

    def __init__(self, code, details="the details", reason=None, service=None):
        self._status = status_for(code, details, ServiceError(details, reason))
        if service is not None:
            self.service = service

    def code(self):
        return self._status.code

    def details(self):
        return self._status.details

    def trailing_metadata(self):
        return self._status.trailing_metadata

    def initial_metadata(self):
        return ()

    def is_active(self):
        return False

    def time_remaining(self):
        return None

    def cancel(self):
        return False

    def add_callback(self, callback):
        return False


@pytest.mark.parametrize(
    "error, outcome, then, fault, kind",
    [
        (
            CallFailed(grpc.StatusCode.FAILED_PRECONDITION, reason=Reason.REWARD_FUNCTION_FAILED, service="reward"),
            Outcome.REWARD_FUNCTION_FAILED,
            Then.STOP,
            None,
            None,
        ),
        (CallFailed(INVALID, service="reward"), Outcome.PROMPT_REFUSED, Then.DEAD_LETTER, None, None),
        (CallFailed(INVALID, reason=Reason.PROMPT_INVALID), Outcome.PROMPT_REFUSED, Then.DEAD_LETTER, None, None),
        (
            CallFailed(UNAVAILABLE, service="critic"),
            Outcome.OTHER_SERVER_FAILED,
            Then.RETRY,
            Fault.ELSEWHERE,
            "unavailable",
        ),
        (
            CallFailed(grpc.StatusCode.DEADLINE_EXCEEDED, service="reward"),
            Outcome.OTHER_SERVER_FAILED,
            Then.RETRY,
            Fault.ELSEWHERE,
            "deadline_exceeded",
        ),
        (CallFailed(INVALID), Outcome.REQUEST_REFUSED, Then.RETRY, Fault.REFUSED, "invalid_argument"),
        (
            CallFailed(grpc.StatusCode.DEADLINE_EXCEEDED),
            Outcome.PAST_DEADLINE,
            Then.RETRY_LONGER,
            Fault.FAILED,
            "deadline_exceeded",
        ),
        (CallFailed(UNAVAILABLE), Outcome.SERVER_FAILED, Then.RETRY, Fault.FAILED, "unavailable"),
        (CallFailed(grpc.StatusCode.INTERNAL), Outcome.SERVER_FAILED, Then.RETRY, Fault.FAILED, "internal"),
        (
            DependencyUnavailable("the reward server did not answer"),
            Outcome.DEPENDENCY_GONE,
            Then.LEAVE_PENDING,
            None,
            "dependency",
        ),
        (ScoringFailed("HTTP 500"), Outcome.UNSCORED, Then.DROP_UNSCORED, None, None),
        (ValueError("prompt 'x' has 20 tokens"), Outcome.PROMPT_REFUSED, Then.DEAD_LETTER, None, None),
    ],
)
def test_each_error_the_worker_knows_has_its_row(error, outcome, then, fault, kind):
    row = classify(error)
    assert (row.outcome, row.then, row.fault) == (outcome, then, fault)
    assert row.counted == (kind is not None)
    if kind is not None:
        assert error_kind(error) == kind  # the kind of rlhf_rollout_errors_total it adds to
    assert message(error) == (error.details() if isinstance(error, grpc.RpcError) else str(error))


def test_an_error_no_row_knows_propagates():
    assert classify(RuntimeError("a bug")) is None
    assert classify(KeyError("x")) is None


def test_the_table_covers_every_outcome_and_only_a_row_that_tries_again_has_a_fault():
    assert {row.outcome for row in TABLE} == set(Outcome)
    assert all((row.fault is not None) == (row.then in (Then.RETRY, Then.RETRY_LONGER)) for row in TABLE)
    with pytest.raises(ValueError, match="has a fault"):
        Row(Rpc(), Outcome.SERVER_FAILED, Then.RETRY)
    with pytest.raises(ValueError, match="has a fault"):
        Row(Rpc(), Outcome.PROMPT_REFUSED, Then.DEAD_LETTER, Fault.FAILED)
