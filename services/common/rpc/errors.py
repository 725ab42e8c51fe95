"""Errors between services as data: the exceptions a servicer raises to choose the gRPC status
the interceptor answers with, and the machine-readable details that ride with it.

A caller that acts on an error (isolate a prompt, count a benign race as delivered, drop a batch
the reward API failed, stop the run) reads a `Reason` from the status's `google.rpc.ErrorInfo`
and the fields from its `google.rpc.BadRequest` (the standard error details, through
grpcio-status), never the message: the message is for people and may be reworded.

    server:  raise BadRequest("prompts[3]: empty prompt", Reason.PROMPT_INVALID, field="prompts[3]")
    client:  except grpc.RpcError as e:
                 if reason_of(e) is Reason.PROMPT_INVALID: ...      # details_of(e).violations too
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass
from dataclasses import field as dc_field

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

DOMAIN = "rlhf.services"  # ErrorInfo.domain of every reason below


class Reason(enum.Enum):
    """Why a call failed, where another service acts on it (each is pinned by a test)."""

    PROMPT_INVALID = "PROMPT_INVALID"
    """Generation: one prompt of the request breaks the contract (the field names which); the
    rest of the request is fine. A rollout worker isolates and dead-letters that prompt; any other
    INVALID_ARGUMENT from a generation server is about the request (its limits differ from the
    worker's config) and the worker tries another server."""
    VERSION_NOT_NEWER = "VERSION_NOT_NEWER"
    """Weights: the server already serves this version or a newer one (it pulled it a moment
    ago). A publisher counts the push as delivered."""
    REWARD_API_FAILED = "REWARD_API_FAILED"
    """Reward (UNAVAILABLE): the user's reward API failed this batch after its retries, while the
    API is not known to be down. A worker scores the batch again a few times, then drops it."""
    REWARD_FUNCTION_FAILED = "REWARD_FUNCTION_FAILED"
    """Reward (FAILED_PRECONDITION): the user's reward function raised. Repeating will not help:
    the worker and the learner stop the run (the message carries the function's traceback)."""
    REQUEST_TOO_LARGE = "REQUEST_TOO_LARGE"
    """Generation (RESOURCE_EXHAUSTED): the request costs more token positions than the server's
    rpc.max_request_tokens: it can never fit, however long one waits. The gateway answers 400
    naming the bound (not 429, which a client retries)."""
    DELTA_BASE_MISSING = "DELTA_BASE_MISSING"
    """Weights (FAILED_PRECONDITION): a delta push against a version the server does not hold (it
    restarted, missed a version, or keeps no delta base). A publisher streams the server the full
    version in the same push."""
    MODEL_NOT_HELD = "MODEL_NOT_HELD"
    """Tinker trainer (FAILED_PRECONDITION): it holds no training model of that id: it restarted
    since the model was made, so the model's weights, optimiser state and accumulated gradients are
    gone. The Tinker API tells its client to start again from a checkpoint; repeating will not help."""


@dataclass(frozen=True)
class Violation:
    """One field of a request that broke the contract (`google.rpc.BadRequest.FieldViolation`)."""

    field: str
    description: str


class ServiceError(Exception):
    """An error with a reason and the fields it is about: what travels as error details."""

    def __init__(
        self,
        message: str,
        reason: Reason | None = None,
        field: str | None = None,
        metadata: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.reason, self.metadata = reason, dict(metadata or {})
        self.violations = (Violation(field, message),) if field is not None else ()


class BadRequest(ServiceError, ValueError):
    """Input that breaks the contract; the servers answer it with INVALID_ARGUMENT."""


class Unavailable(ServiceError):
    """A dependency could not answer (e.g. an external reward API); mapped to UNAVAILABLE."""


class ResourceExhausted(ServiceError):
    """A request that would cost more than the server allows (tokens x samples); RESOURCE_EXHAUSTED."""


class FailedPrecondition(ServiceError):
    """The server's own configured code failed on this input (a user's reward function raised);
    FAILED_PRECONDITION: repeating the call will not help, the run must stop (its details say why).
    (A delta weight push the server has no base for is refused this way too, with its own reason.)"""


class DeadlineExceeded(ServiceError):
    """The caller's deadline passed while the work was running; DEADLINE_EXCEEDED."""


class Unimplemented(ServiceError):
    """A method this server's backend cannot serve (vLLM's ScoreTokens); UNIMPLEMENTED, as a
    server too old to have the method answers."""


class _Status(collections.namedtuple("_Status", ("code", "details", "trailing_metadata")), grpc.Status):
    pass


def status_for(
    code: grpc.StatusCode, message: str, error: BaseException | None = None, trailing: tuple = ()
) -> grpc.Status:
    """The status a server aborts with: `code`, `message` and, for a `ServiceError`, its
    `ErrorInfo` (reason, metadata) and `BadRequest` (field violations) details. (They travel in
    a trailer beside the message: each violation's description is cut to 200 characters.)
    `trailing`: more trailing metadata (aborting replaces what the call had set)."""
    status = status_pb2.Status(code=code.value[0], message=message)
    if isinstance(error, ServiceError):
        if error.reason is not None:
            info = error_details_pb2.ErrorInfo(reason=error.reason.value, domain=DOMAIN, metadata=error.metadata)
            status.details.append(_packed(any_pb2.Any(), info))
        if error.violations:
            bad = error_details_pb2.BadRequest(
                field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description[:200])
                    for v in error.violations
                ]
            )
            status.details.append(_packed(any_pb2.Any(), bad))
    plain = rpc_status.to_status(status)  # the details as the standard trailer
    return _Status(plain.code, plain.details, tuple(plain.trailing_metadata) + tuple(trailing))


def _packed(holder, message):
    holder.Pack(message)
    return holder


@dataclass(frozen=True)
class ErrorDetails:
    """What a failed call's status says beyond its code."""

    reason: Reason | None = None
    metadata: dict[str, str] = dc_field(default_factory=dict)
    violations: tuple[Violation, ...] = ()


def details_of(e: BaseException) -> ErrorDetails:
    """The error details of a failed call (`grpc.RpcError`); empty for any other exception, a
    status without details, or a reason of another domain or version of this system."""
    if not isinstance(e, grpc.Call):
        return ErrorDetails()
    reason, metadata, violations = None, {}, []
    try:
        status = rpc_status.from_call(e)
        for detail in status.details if status is not None else ():
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                if info.domain == DOMAIN and info.reason in Reason.__members__:
                    reason, metadata = Reason[info.reason], dict(info.metadata)
            elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad = error_details_pb2.BadRequest()
                detail.Unpack(bad)
                violations += [Violation(v.field, v.description) for v in bad.field_violations]
    except (ValueError, DecodeError):  # a status that disagrees with the call's, or bytes that are no Status
        return ErrorDetails()
    return ErrorDetails(reason, metadata, tuple(violations))


def reason_of(e: BaseException) -> Reason | None:
    """The `Reason` a failed call carries, if any."""
    return details_of(e).reason
