"""The exceptions a servicer raises to choose the gRPC status the interceptor answers with."""


class BadRequest(ValueError):
    """Input that breaks the contract; the servers answer it with INVALID_ARGUMENT."""


class Unavailable(Exception):
    """A dependency could not answer (e.g. an external reward API); mapped to UNAVAILABLE."""


class ResourceExhausted(Exception):
    """A request that would cost more than the server allows (tokens x samples); RESOURCE_EXHAUSTED."""


class FailedPrecondition(Exception):
    """The server's own configured code failed on this input (a user's reward function raised);
    FAILED_PRECONDITION: repeating the call will not help, the run must stop (its details say why)."""


class DeadlineExceeded(Exception):
    """The caller's deadline passed while the work was running; DEADLINE_EXCEEDED."""
