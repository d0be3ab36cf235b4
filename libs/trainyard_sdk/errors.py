"""The SDK's exceptions, and the one table that turns a gateway answer into one of them.

Every failure of a call is an `SdkError`:

| exception                            | when                                                         |
|--------------------------------------|--------------------------------------------------------------|
| `InvalidArgument` (400, 422)         | the request breaks the API's schema (also raised before sending: see below) |
| ├ `IdempotencyKeyReused` (422)       | the Idempotency-Key was used for another body                |
| └ `InvalidPageToken` (422)           | a page token not handed out for these filters                |
| `Unauthenticated` (401)              | no token, or not a valid one                                 |
| `PermissionDenied` (403)             | the token's role or scopes do not allow it                   |
| `NotFound` (404)                     | absent, or another team's                                    |
| `Conflict` (409)                     | `conflict`: a concurrent change won; read again and retry    |
| ├ `FailedPrecondition` (409)         | well formed, but the cluster cannot take it as it is now     |
| └ `AlreadyExists` (409)              |                                                              |
| `RateLimited` (429)                  | the token's rate limit; `retry_after` seconds                |
| `Unavailable` (503)                  | the scheduler, an agent or etcd cannot be reached; `retry_after` |
| `InsufficientStorage` (507)          | etcd is out of space; an operator must free it               |
| `ApiError`                           | any other status (500 `internal`, 405, 413, ...)             |
| `ConnectionFailed`                   | no answer: refused, unknown host, TLS, timeout, a stream lost for good |
| `ProtocolError`                      | an answer the API does not document (not JSON, not the model) |
| `ConfigurationError`                 | no gateway URL or token found, a URL that is not http(s)     |

An `ApiError` carries the answer's `status`, the API's machine-readable `code` (`not_found`,
`failed_precondition`, ...), its `message` and the `request_id` the gateway logged and audited the call under
(the `X-Request-Id` the SDK sends with every request; the gateway echoes it on writes). A request body that
fails the gateway's request model is refused before anything is sent, as the `InvalidArgument` the gateway
would answer (status 400, its message, no request id). `error_for` is pure:
status, headers and body in, exception out. A class is chosen by the code first (so a 422 with
`idempotency_key_reused` is `IdempotencyKeyReused`), then by the status.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from email.utils import parsedate_to_datetime
from typing import Any


class SdkError(Exception):
    """Base of every exception the SDK raises."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ConfigurationError(SdkError):
    """The client cannot be configured: no gateway URL or token found, or one that is not usable."""


class ConnectionFailed(SdkError):
    """No answer from the gateway: the connection was refused (`refused`: nothing was sent) or dropped, the host
    is unknown, TLS failed, or the gateway did not answer in time (`timed_out`)."""

    def __init__(self, message: str, *, url: str, timed_out: bool = False, refused: bool = False) -> None:
        super().__init__(message)
        self.url = url
        self.timed_out = timed_out
        self.refused = refused


class ProtocolError(SdkError):
    """The gateway answered something the API does not document (not JSON, or not the expected model)."""


class ApiError(SdkError):
    """The gateway answered with an error: `status` (HTTP), `code` (the API's), `message`, `request_id`."""

    def __init__(self, status: int, code: str, message: str, request_id: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.request_id = request_id

    def __str__(self) -> str:
        return f"{self.message} ({self.status} {self.code})" if self.code else f"{self.message} ({self.status})"

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(status={self.status}, code={self.code!r}, message={self.message!r}, "
                f"request_id={self.request_id!r})")


class InvalidArgument(ApiError):
    """400: the request breaks the published contract (the message names each offending field); 422: well formed
    but not usable as meant (the subclasses)."""


class IdempotencyKeyReused(InvalidArgument):
    """422: the Idempotency-Key was used for another request body; use a new key."""


class InvalidPageToken(InvalidArgument):
    """422: a page token not handed out for these filters; start from the first page."""


class Unauthenticated(ApiError):
    """401: no token, or a token that is not valid (expired, revoked, unknown)."""


class PermissionDenied(ApiError):
    """403: the token's role or scopes do not allow this."""


class NotFound(ApiError):
    """404: no such object, or one of another team."""


class Conflict(ApiError):
    """409: conflicts with the cluster's current state (`code` conflict: a concurrent change won; retry after
    reading again). The subclasses are the other 409 codes."""


class FailedPrecondition(Conflict):
    """409 failed_precondition: well formed, but the cluster cannot take it as it is (no node that large, no
    such queue, a job in the wrong state for the operation)."""


class AlreadyExists(Conflict):
    """409 already_exists."""


class _Retryable(ApiError):
    def __init__(self, status: int, code: str, message: str, request_id: str = "", *,
                 retry_after: float | None = None) -> None:
        super().__init__(status, code, message, request_id)
        self.retry_after = retry_after


class RateLimited(_Retryable):
    """429: the token's rate limit (or a quota) was reached; `retry_after`: seconds the gateway asked to wait."""


class Unavailable(_Retryable):
    """503: a dependency (scheduler, agent, etcd, checkpoint-store) cannot be reached; `retry_after` seconds."""


class InsufficientStorage(ApiError):
    """507: etcd is out of space; the write was not applied. Not retried: space comes back when an operator frees
    it."""


BY_CODE: Mapping[str, type[ApiError]] = {
    "idempotency_key_reused": IdempotencyKeyReused,
    "invalid_page_token": InvalidPageToken,
    "failed_precondition": FailedPrecondition,
    "already_exists": AlreadyExists,
}
BY_STATUS: Mapping[int, type[ApiError]] = {
    400: InvalidArgument, 422: InvalidArgument, 401: Unauthenticated, 403: PermissionDenied, 404: NotFound,
    409: Conflict, 429: RateLimited, 503: Unavailable, 507: InsufficientStorage,
}
_SNIPPET = 200


def retry_after(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """Seconds a `Retry-After` header asks for (delta-seconds, or an HTTP date when `now` is given); None when
    absent or unreadable. `headers` has lower-case keys."""
    value = headers.get("retry-after", "").strip()
    if not value:
        return None
    if value.isdigit():
        return float(value)
    if now is None:
        return None
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - now)
    except (TypeError, ValueError):
        return None


def _error_body(body: bytes) -> tuple[str, str]:
    try:
        data: Any = json.loads(body)
    except ValueError:
        return "", ""
    error = data.get("error") if isinstance(data, dict) else None
    if not isinstance(error, dict):
        return "", ""
    return str(error.get("code", "")), str(error.get("message", ""))


def error_for(status: int, reason: str, headers: Mapping[str, str], body: bytes, *, sent_request_id: str = "",
              now: float | None = None) -> ApiError:
    """The exception for an error answer. Pure. `headers` with lower-case keys. A body that is not the API's
    error shape (a proxy's HTML page) still gives a message: the status and the start of the body."""
    code, message = _error_body(body)
    if not message:
        message = f"the gateway answered {status} {reason}".rstrip()
        snippet = body[:_SNIPPET].decode("utf-8", "replace").strip()
        if snippet:
            message += f": {snippet}"
    request_id = headers.get("x-request-id", "") or sent_request_id
    cls = BY_CODE.get(code) or BY_STATUS.get(status, ApiError)
    if issubclass(cls, _Retryable):
        return cls(status, code, message, request_id, retry_after=retry_after(headers, now))
    return cls(status, code, message, request_id)
