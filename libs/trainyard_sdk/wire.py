"""What the two clients share: a call as data, and the pure decisions around sending it.

An operation of the API is built once, as a `Call` (the `Request` to send and the function that turns the
`Answer` into a typed result), by the functions of `operations.py`; `Client` and `AsyncClient` only send
requests and read answers (their I/O is the one thing they do not share). So are a listing, a `Paging` (the
call for a page token, the items of a page, the next token), and a stream, a `StreamCall` (the request, and
the function that turns each server-sent event into a result).

The decisions are pure functions here:
- `check(call, answer)`: the error an answer is (errors.error_for), or the parsed result;
- `Retry.delay(request, attempt, error)`: whether and after how long a failed call is sent again. Only
  requests that are safe to repeat are retried: reads (GET), and writes that carry an Idempotency-Key (the
  gateway answers a repeat with the first result). 429 and 503 are retried after the `Retry-After` they
  carry, a connection never made (refused, or its connect timed out: nothing was sent) after a backoff; a
  `Retry-After` longer than `max_delay_s` is not waited for (the error is raised at once, with its
  `retry_after`). Read timeouts and dropped connections are not retried: the gateway may have acted.
- `Resume`: the state of a stream across reconnections (the last event id it sends back as Last-Event-ID,
  the delay before the next attempt, and when to give up);
- `reads_at(request, revision)`: a read of jobs asks for at least the highest etcd revision the client was
  answered with (X-Trainyard-Revision), so a client reads its own writes from any gateway replica.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ValidationError

from .errors import ConnectionFailed, ProtocolError, RateLimited, SdkError, Unavailable, error_for
from .sse import SseEvent

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

IDEMPOTENCY_HEADER = "Idempotency-Key"
REQUEST_ID_HEADER = "X-Request-Id"
LAST_EVENT_ID_HEADER = "Last-Event-ID"
# The etcd revision a job answer reflects (trainyard_gateway.job_view_reads): sent back on reads of jobs, a
# replica of the gateway answers with what it has seen at least that far (a client reads its own writes).
REVISION_HEADER = "X-Trainyard-Revision"


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str  # below the gateway URL, path parameters already quoted
    params: tuple[tuple[str, str], ...] = ()
    body: Any = None  # a JSON value; None: no body
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def repeatable(self) -> bool:
        """Safe to send twice: a read, or a write the gateway deduplicates by its Idempotency-Key."""
        return self.method in ("GET", "HEAD") or any(k == IDEMPOTENCY_HEADER for k, _ in self.headers)

    def with_header(self, name: str, value: str) -> Request:
        return replace(self, headers=(*((k, v) for k, v in self.headers if k.lower() != name.lower()),
                                      (name, value)))


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    reason: str
    headers: Mapping[str, str]  # lower-case names
    body: bytes


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """One request and how its answer becomes a result. `accept`: error statuses whose body is a result too
    (GET /healthz answers its Health with 503)."""

    request: Request
    parse: Callable[[Answer], T]
    accept: frozenset[int] = frozenset()


@dataclass(frozen=True, slots=True)
class Paging(Generic[T]):
    """A listing: `page(token)` is the call for one page ("" the first), `items` and `next_token` read it."""

    page: Callable[[str], Call[Any]]
    items: Callable[[Any], Sequence[T]]
    next_token: Callable[[Any], str]


def _never(_: SseEvent) -> bool:
    return False


@dataclass(frozen=True, slots=True)
class StreamCall(Generic[T]):
    """A stream of server-sent events: `decode` turns each into a result, or None to pass over it (a kind
    this SDK does not know yet); after an event `final` says is the last, the stream ends even if the
    connection is not closed yet."""

    request: Request
    decode: Callable[[SseEvent], T | None]
    final: Callable[[SseEvent], bool] = _never
    last_event_id: str = ""  # resume after this event (one an earlier stream saw)


def new_request_id() -> str:
    return "sdk-" + uuid.uuid4().hex


def lower_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


def revision_of(answer: Answer) -> int:
    value = answer.headers.get(REVISION_HEADER.lower(), "")
    return int(value) if value.isdigit() else 0


def reads_at(request: Request, revision: int) -> Request:
    """A read of jobs (`GET /v1/jobs`, `GET /v1/jobs/{id}`) asked to reflect at least `revision`, the highest this
    client has been answered with: after a write, the same client never reads an older state, from any replica."""
    parts = request.path.split("/")
    is_job_read = request.method == "GET" and parts[1:3] == ["v1", "jobs"] and (
        len(parts) == 3 or (len(parts) == 4 and ":" not in parts[3]))
    return request.with_header(REVISION_HEADER, str(revision)) if revision and is_job_read else request


def check(call: Call[T], answer: Answer, *, request_id: str, now: float | None = None) -> T:
    """The call's result, or the ApiError the answer is. Pure."""
    if answer.status >= 400 and answer.status not in call.accept:
        raise error_for(answer.status, answer.reason, answer.headers, answer.body, sent_request_id=request_id,
                        now=now)
    return call.parse(answer)


def model(cls: type[M]) -> Callable[[Answer], M]:
    """A parser of a JSON answer into `cls`. Fields a newer gateway added are ignored (its models forbid them
    in requests, not in what a client reads)."""

    def parse(answer: Answer) -> M:
        try:
            return cls.model_validate_json(answer.body, extra="ignore")
        except ValidationError as exc:
            raise ProtocolError(f"the gateway's answer is not a {cls.__name__}: {_first(exc)}") from None

    return parse


def field_of(cls: type[M], read: Callable[[M], T]) -> Callable[[Answer], T]:
    """A parser of `cls` that keeps one field (the list of a `{"nodes": [...]}` answer)."""
    whole = model(cls)
    return lambda answer: read(whole(answer))


def text(answer: Answer) -> str:
    return answer.body.decode("utf-8", "replace")


def _first(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ())) or "answer"
    return f"{where}: {err.get('msg', 'invalid')}"


@dataclass(frozen=True, slots=True)
class Retry:
    """Automatic retries of repeatable requests (see the module's docstring). `max_attempts` counts the first
    one; `Retry(max_attempts=1)` (or `retry=None` on a client) turns retries off."""

    max_attempts: int = 3
    max_delay_s: float = 10.0
    backoff_s: float = 0.5  # after a refused connection: backoff_s, 2x, 4x, ... capped at max_delay_s

    def delay(self, request: Request, attempt: int, error: SdkError) -> float | None:
        """Seconds to wait before attempt `attempt + 1` after `error` ended attempt `attempt` (1-based); None:
        raise it. Pure."""
        if attempt >= self.max_attempts or not request.repeatable:
            return None
        if isinstance(error, RateLimited | Unavailable):
            wait = error.retry_after if error.retry_after is not None else self._backoff(attempt)
            return wait if wait <= self.max_delay_s else None
        if isinstance(error, ConnectionFailed) and error.refused:
            return self._backoff(attempt)
        return None

    def _backoff(self, attempt: int) -> float:
        return float(min(self.max_delay_s, self.backoff_s * 2 ** (attempt - 1)))


NO_RETRY = Retry(max_attempts=1)


@dataclass(frozen=True, slots=True)
class Reconnect:
    """How a stream reconnects after its connection dropped: at most `max_failures` attempts in a row without an
    event in between, after `backoff_s` doubling up to `max_delay_s` (or the server's `retry:`, or a 503's
    Retry-After). `Reconnect(max_failures=0)` never reconnects."""

    max_failures: int = 5
    backoff_s: float = 0.5
    max_delay_s: float = 10.0


@dataclass(slots=True)
class Resume:
    """A stream's state across connections: `request()` for the next connection (with Last-Event-ID once an
    event had an id), `seen()` for each event, `dropped()` when a connection failed: the delay before
    reconnecting, or None to give up. Pure (the caller sleeps)."""

    policy: Reconnect
    last_event_id: str = ""
    retry_ms: int | None = None
    failures: int = 0
    reconnects: int = 0

    def request(self, base: Request) -> Request:
        return base.with_header(LAST_EVENT_ID_HEADER, self.last_event_id) if self.last_event_id else base

    def seen(self, event: SseEvent, retry_ms: int | None) -> None:
        self.last_event_id = event.id or self.last_event_id
        self.retry_ms = retry_ms if retry_ms is not None else self.retry_ms
        self.failures = 0

    def dropped(self, error: SdkError) -> float | None:
        if not isinstance(error, ConnectionFailed | RateLimited | Unavailable):
            return None  # the stream's own refusal (404, 403, ...) or a wrong answer: reconnecting changes nothing
        self.failures += 1
        if self.failures > self.policy.max_failures:
            return None
        self.reconnects += 1
        limit = self.policy.max_delay_s
        if isinstance(error, RateLimited | Unavailable) and error.retry_after is not None:
            return min(limit, error.retry_after)
        if self.retry_ms is not None:
            return min(limit, self.retry_ms / 1000)
        return float(min(limit, self.policy.backoff_s * 2 ** (self.failures - 1)))
