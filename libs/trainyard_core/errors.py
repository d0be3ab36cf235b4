"""Domain errors. Raised by domain and service code; mapped to gRPC/HTTP status in exactly one place each
(`trainyard_core.rpc.errors` and the gateway's exception handlers).

Each error carries a message meant for the caller: say what is wrong and how to fix it.
"""

from __future__ import annotations


class TrainyardError(Exception):
    """Base of every domain error."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(TrainyardError):
    """The request itself is wrong; retrying it unchanged will fail again."""


class IdempotencyKeyReused(InvalidArgument):
    """A submit's idempotency key was used before for another request (another body or user): the retry
    would silently answer with a job that is not the one asked for. Use a new key."""


class InvalidPageToken(InvalidArgument):
    """A page token that is well formed but not one this listing handed out, or one handed out for other
    filters: start again from the first page."""


class NotFound(TrainyardError):
    pass


class AlreadyExists(TrainyardError):
    pass


class FailedPrecondition(TrainyardError):
    """The request is valid but the system is not in a state that allows it."""


class Conflict(TrainyardError):
    """A concurrent change won (compare-and-swap lost); the caller may retry."""


class PermissionDenied(TrainyardError):
    pass


class Unauthenticated(TrainyardError):
    pass


class ResourceExhausted(TrainyardError):
    pass


class Unavailable(TrainyardError):
    """A dependency (etcd, another service) cannot be reached now; retry later."""


class Busy(Unavailable):
    """This server is busy with calls like this one (rpc/admission.py): the call was refused before it did
    anything; retry after `retry_after_s` seconds (which the gRPC answer carries as trailing metadata)."""

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class StoreOutOfSpace(ResourceExhausted, Unavailable):
    """etcd refused a write because its database reached its space quota (the NOSPACE alarm). The write was
    not applied: unlike a plain Unavailable its outcome is known. Callers see RESOURCE_EXHAUSTED; it is an
    Unavailable too, so the loops that wait out an unreachable store (reconcile, election, audit) wait out
    this one the same way, until an operator frees space (docs/operations.md, "etcd space")."""


class NotLeader(Unavailable):
    """This replica is not the leader; `leader` names the one that is, when known."""

    def __init__(self, message: str, leader: str = "") -> None:
        super().__init__(message)
        self.leader = leader
