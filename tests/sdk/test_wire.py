"""The SDK's pure decisions, as tables: which exception an answer is, when a failed call is sent again, when a
dropped stream reconnects, and how arguments become a request (checked before anything is sent)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone
from email.utils import format_datetime

import pytest

from trainyard_gateway import job_view_reads
from trainyard_sdk import errors as e
from trainyard_sdk import operations as ops
from trainyard_sdk import streams
from trainyard_sdk.request_parts import query
from trainyard_sdk.sse import SseEvent
from trainyard_sdk.wire import REVISION_HEADER, Answer, Reconnect, Request, Resume, Retry, reads_at, revision_of


def _body(code: str, message: str = "m") -> bytes:
    return json.dumps({"error": {"code": code, "message": message}}).encode()


@pytest.mark.parametrize(("status", "code", "cls"), [
    (400, "invalid_argument", e.InvalidArgument),
    (422, "idempotency_key_reused", e.IdempotencyKeyReused),
    (422, "invalid_page_token", e.InvalidPageToken),
    (401, "unauthenticated", e.Unauthenticated),
    (403, "permission_denied", e.PermissionDenied),
    (404, "not_found", e.NotFound),
    (409, "conflict", e.Conflict),
    (409, "failed_precondition", e.FailedPrecondition),
    (409, "already_exists", e.AlreadyExists),
    (429, "resource_exhausted", e.RateLimited),
    (503, "unavailable", e.Unavailable),
    (507, "insufficient_storage", e.InsufficientStorage),
    (500, "internal", e.ApiError),
    (405, "method_not_allowed", e.ApiError),
])
def test_each_answer_is_its_family(status: int, code: str, cls: type[e.ApiError]) -> None:
    err = e.error_for(status, "Reason", {"x-request-id": "req-1"}, _body(code, "what happened"))
    assert type(err) is cls
    assert (err.status, err.code, err.message, err.request_id) == (status, code, "what happened", "req-1")
    assert str(err) == f"what happened ({status} {code})"


def test_the_families_nest() -> None:
    assert issubclass(e.FailedPrecondition, e.Conflict) and issubclass(e.AlreadyExists, e.Conflict)
    assert issubclass(e.IdempotencyKeyReused, e.InvalidArgument) and issubclass(e.InvalidPageToken, e.InvalidArgument)
    assert all(issubclass(cls, e.ApiError) for cls in e.BY_STATUS.values())
    assert issubclass(e.ApiError, e.SdkError) and issubclass(e.ConnectionFailed, e.SdkError)


def test_retry_after_in_seconds_or_as_a_date() -> None:
    assert e.error_for(429, "", {"retry-after": "7"}, _body("resource_exhausted")).retry_after == 7  # type: ignore[attr-defined]
    assert e.error_for(503, "", {}, _body("unavailable")).retry_after is None  # type: ignore[attr-defined]
    now = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
    date = format_datetime(now + timedelta(seconds=30), usegmt=True)
    assert e.retry_after({"retry-after": date}, now=now.timestamp()) == 30
    assert e.retry_after({"retry-after": "soon"}, now=now.timestamp()) is None


def test_an_answer_that_is_not_the_apis_error_still_says_what_came() -> None:
    err = e.error_for(502, "Bad Gateway", {}, b"<html>upstream down</html>", sent_request_id="sdk-1")
    assert type(err) is e.ApiError
    assert (err.code, err.message, err.request_id) == ("", "the gateway answered 502 Bad Gateway: <html>upstream "
                                                           "down</html>", "sdk-1")
    assert str(err) == f"{err.message} (502)"


# --- retries ------------------------------------------------------------------------------------------------

GET = Request("GET", "/v1/jobs")
POST = Request("POST", "/v1/jobs")
KEYED = Request("POST", "/v1/jobs", headers=(("Idempotency-Key", "k1"),))


def _busy(retry_after: float | None) -> e.Unavailable:
    return e.Unavailable(503, "unavailable", "busy", retry_after=retry_after)


def _limited(retry_after: float | None) -> e.RateLimited:
    return e.RateLimited(429, "resource_exhausted", "slow down", retry_after=retry_after)


REFUSED = e.ConnectionFailed("refused", url="u", refused=True)
TIMED_OUT = e.ConnectionFailed("slow", url="u", timed_out=True)
DROPPED = e.ConnectionFailed("lost", url="u")


@pytest.mark.parametrize(("request_", "attempt", "error", "delay"), [
    (GET, 1, _busy(1), 1.0),               # a read after a 503: its Retry-After
    (GET, 2, _limited(3), 3.0),
    (GET, 3, _busy(1), None),              # max_attempts (3) reached
    (GET, 1, _busy(None), 0.5),            # no Retry-After: the backoff
    (GET, 2, _busy(None), 1.0),
    (GET, 1, _limited(60), None),          # longer than max_delay_s: not waited for
    (POST, 1, _busy(1), None),             # a write without an Idempotency-Key: never
    (POST, 1, REFUSED, None),
    (KEYED, 1, _busy(1), 1.0),             # with one: the gateway answers a repeat with the first job
    (GET, 1, REFUSED, 0.5),                # nothing was sent
    (GET, 1, TIMED_OUT, None),             # the gateway may have answered
    (GET, 1, DROPPED, None),
    (GET, 1, e.NotFound(404, "not_found", "no"), None),
    (GET, 1, e.InsufficientStorage(507, "insufficient_storage", "full"), None),
])
def test_when_a_call_is_sent_again(request_: Request, attempt: int, error: e.SdkError, delay: float | None) -> None:
    assert Retry(max_attempts=3, max_delay_s=10, backoff_s=0.5).delay(request_, attempt, error) == delay


def test_one_attempt_is_no_retry() -> None:
    assert Retry(max_attempts=1).delay(GET, 1, _busy(1)) is None


# --- resuming streams ---------------------------------------------------------------------------------------

def test_a_stream_resumes_from_its_last_event_id_and_gives_up_after_failures_in_a_row() -> None:
    resume = Resume(Reconnect(max_failures=2, backoff_s=0.5, max_delay_s=10))
    base = Request("GET", "/v1/jobs/j/logs", params=(("follow", "true"),))
    assert resume.request(base) == base  # no event yet: no Last-Event-ID
    assert resume.dropped(DROPPED) == 0.5
    assert resume.dropped(REFUSED) == 1.0
    resume.seen(SseEvent("line", "{}", "p1"), None)  # an event in between: the count starts again
    assert resume.request(base).headers == (("Last-Event-ID", "p1"),)
    assert resume.dropped(DROPPED) == 0.5
    resume.seen(SseEvent("line", "{}", ""), 2000)  # an event without an id keeps the last one; retry: 2 s
    assert resume.last_event_id == "p1"
    assert resume.dropped(_busy(None)) == 2.0
    assert resume.dropped(_busy(4)) == 4.0  # a 503's Retry-After first
    assert resume.dropped(DROPPED) is None  # a third failure in a row
    assert resume.reconnects == 5


@pytest.mark.parametrize("error", [e.NotFound(404, "not_found", "gone"), e.PermissionDenied(403, "", "no"),
                                   e.ProtocolError("not an event stream")])
def test_a_refusal_ends_a_stream(error: e.SdkError) -> None:
    assert Resume(Reconnect()).dropped(error) is None


# --- requests ---------------------------------------------------------------------------------------------

def test_query_values() -> None:
    at = datetime(2026, 12, 1, 8, 30, tzinfo=timezone(timedelta(hours=1)))
    assert query(state=["failed", "cancelled"], user="", team=None, from_=at, follow=True, tail=0) == [
        ("state", "failed"), ("state", "cancelled"), ("from", "2026-12-01T08:30:00+01:00"), ("follow", "true"),
        ("tail", "0")]


def test_a_time_without_a_zone_is_refused_before_sending() -> None:
    with pytest.raises(e.InvalidArgument, match="submitted_after: a datetime with a time zone is required"):
        ops.list_jobs_page(submitted_after=datetime(2026, 12, 1))


def test_an_empty_path_parameter_is_refused_before_sending() -> None:
    with pytest.raises(e.InvalidArgument, match="path parameter job_id: required"):
        ops.get_job("")
    with pytest.raises(e.InvalidArgument, match="path parameter tag: required"):
        ops.tag_checkpoint("job-1", "ckpt-1", "")


def test_path_parameters_are_quoted() -> None:
    assert ops.get_job("a/b?c").request.path == "/v1/jobs/a%2Fb%3Fc"


def test_bodies_are_what_the_caller_gave_validated() -> None:
    spec = {"name": "x", "command": ["true"], "resources": {"nodes": 1, "gpus_per_node": 1.0}}
    call = ops.submit_job(spec, idempotency_key="key-1")
    assert call.request.body == {"name": "x", "command": ["true"], "resources": {"nodes": 1, "gpus_per_node": 1}}
    assert call.request.headers == (("Idempotency-Key", "key-1"),) and call.request.repeatable
    patch = ops.resubmit_job("job-1", {"env": {"DEBUG": None}, "resources": {"nodes": 4}}).request.body
    assert patch == {"overrides": {"env": {"DEBUG": None}, "resources": {"nodes": 4}}}  # a merge patch keeps its nulls
    assert ops.cancel_job("job-1").request.body is None and ops.cancel_job("job-1", reason="r").request.body == {
        "reason": "r"}


def test_streams_ask_for_what_they_follow() -> None:
    call = streams.follow_logs("job-1", tail=5, rank=[0, 3], attempt=2, last_event_id="p9")
    assert call.request.params == (("follow", "true"), ("tail", "5"), ("attempt", "2"), ("rank", "0"),
                                   ("rank", "3"))
    assert call.last_event_id == "p9"
    assert Resume(Reconnect(), last_event_id=call.last_event_id).request(call.request).headers == (
        ("Last-Event-ID", "p9"),)
    assert call.decode(SseEvent("line", json.dumps({"rank": 0, "attempt": 2, "node": "n", "stream": "stdout",
                                                    "time": None, "text": "hi", "added": 1})))
    assert call.decode(SseEvent("someday", "{}")) is None  # a kind this SDK does not know: passed over
    assert call.final(SseEvent("end", "{}")) and not call.final(SseEvent("line", "{}"))
    with pytest.raises(e.ProtocolError, match="'line' event of the stream is not a LineEvent"):
        call.decode(SseEvent("line", "{}"))


def test_reads_of_jobs_ask_for_the_revision_the_client_has_seen() -> None:
    assert REVISION_HEADER == job_view_reads.REVISION_HEADER
    answered = Answer(201, "Created", {"x-trainyard-revision": "42"}, b"{}")
    assert revision_of(answered) == 42 and revision_of(Answer(200, "OK", {}, b"")) == 0
    for request, asks in [(ops.get_job("job-1").request, True), (ops.list_jobs_page().request, True),
                          (ops.job_logs("job-1").request, False), (ops.cancel_job("job-1").request, False),
                          (ops.list_nodes().request, False), (ops.list_checkpoints_page("job-1").request, False)]:
        assert (dict(reads_at(request, 42).headers).get(REVISION_HEADER) == "42") is asks, request
    assert reads_at(ops.get_job("job-1").request, 0).headers == ()
