"""Which jobs a listing returns, and its page tokens: pure functions shared by the live (etcd) and the
finished (history store) halves of ListJobs.

A listing is newest first: job ids sort by submission time, so "newest first" is "job id descending" in both
stores, and a page ends where the next one starts (keyset paging, never offsets). A job submitted while a
client pages is newer than every job already shown, so it appears on a fresh first page and never shifts
the pages after it; a job that moves from etcd to the history store between two pages keeps its id, so it is
shown exactly once.

Page tokens are opaque to clients: base64url of the cursor (the last job id shown) and a digest of the
filter, so that a token is refused, with a message saying why, when it is sent with another filter than the
one it came from (the pages would otherwise silently skip or repeat jobs). A token grants nothing: every
page is scoped by the caller's team whatever the token says.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from trainyard_core import contract
from trainyard_core.errors import InvalidArgument, InvalidPageToken
from trainyard_core.ids import is_valid_id

from .models import Job, JobState

_TOKEN_VERSION = 1


@dataclass(frozen=True, slots=True)
class JobFilter:
    """What a listing returns: every field that is set must match ("" / empty / None: any). Times are unix
    seconds; an `_after` bound is inclusive, a `_before` bound exclusive. A job that has not finished never
    matches a `finished_` bound."""

    team: str = ""
    user: str = ""
    states: frozenset[str] = frozenset()  # JobState values
    queue: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)  # every pair must match
    name_prefix: str = ""
    submitted_after: float | None = None
    submitted_before: float | None = None
    finished_after: float | None = None
    finished_before: float | None = None

    @property
    def needs_history(self) -> bool:
        """Whether finished jobs can match (no state filter, or one that names a terminal state)."""
        return not self.states or any(JobState(s).terminal for s in self.states)

    def digest(self) -> str:
        """A short, stable fingerprint of the filter, which its page tokens carry."""
        fields = asdict(self)
        fields["states"] = sorted(self.states)
        fields["labels"] = sorted(self.labels.items())
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def matches(job: Job, flt: JobFilter) -> bool:
    """Whether a job (live or finished) is one `flt` lists."""
    if (flt.team and job.team != flt.team) or (flt.user and job.user != flt.user):
        return False
    if (flt.states and job.state.value not in flt.states) or (flt.queue and job.spec.queue != flt.queue):
        return False
    if flt.name_prefix and not job.spec.name.startswith(flt.name_prefix):
        return False
    if any(job.spec.labels.get(k) != v for k, v in flt.labels.items()):
        return False
    if not _within(job.created_at, flt.submitted_after, flt.submitted_before):
        return False
    if flt.finished_after is None and flt.finished_before is None:
        return True
    return job.finished_at is not None and _within(job.finished_at, flt.finished_after, flt.finished_before)


def _within(t: float, after: float | None, before: float | None) -> bool:
    return (after is None or t >= after) and (before is None or t < before)


def check_filter(flt: JobFilter) -> None:
    """InvalidArgument, naming the field and what it must be, for a filter no job could be listed by."""
    named = (("user", flt.user, contract.USER), ("queue", flt.queue, contract.QUEUE_NAME))
    for what, value, rule in named:
        if value and not rule.matches(value):
            raise InvalidArgument(f"{what} filter {value!r} must be {rule.rule}")
    if flt.team and not contract.TEAM.matches(flt.team):
        raise InvalidArgument(f"team {flt.team!r} must be {contract.TEAM.rule}")
    for state in flt.states:
        if state not in contract.JOB_STATES:
            raise InvalidArgument(f"state filter {state!r} must be one of {', '.join(contract.JOB_STATES)}")
    if len(flt.name_prefix) > contract.MAX_JOB_NAME_LENGTH or not contract.NO_NUL.matches(flt.name_prefix):
        raise InvalidArgument(f"name_prefix must be at most {contract.MAX_JOB_NAME_LENGTH} characters, without NUL")
    if len(flt.labels) > contract.MAX_LABELS:
        raise InvalidArgument(f"at most {contract.MAX_LABELS} label filters, not {len(flt.labels)}")
    for key, value in flt.labels.items():
        if not contract.LABEL_KEY.matches(key):
            raise InvalidArgument(f"label filter key {key!r} must be {contract.LABEL_KEY.rule}")
        if len(value) > contract.MAX_LABEL_VALUE_LENGTH or not contract.NO_NUL.matches(value):
            raise InvalidArgument(f"label filter {key}: the value must be at most "
                                  f"{contract.MAX_LABEL_VALUE_LENGTH} characters, without NUL")
    # Time bounds are not checked against each other: an empty range (after at or past before), or one before
    # 1970, is a filter that nothing matches, answered with an empty page, not an error (the gateway's schema
    # calls any two times valid).
    for bound in (flt.submitted_after, flt.submitted_before, flt.finished_after, flt.finished_before):
        if bound is not None and not contract.MIN_UNIX_TIME_S <= bound <= contract.MAX_UNIX_TIME_S:
            raise InvalidArgument(f"time bound {bound!r} is not a time of years 1-9999 (unix seconds)")


def encode_token(last_job_id: str, flt: JobFilter) -> str:
    """The token of the page after the one that ended with `last_job_id`."""
    raw = json.dumps({"v": _TOKEN_VERSION, "b": last_job_id, "f": flt.digest()}, separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_token(token: str, flt: JobFilter) -> str:
    """The cursor a token carries (only jobs with ids below it are listed); InvalidPageToken (an
    InvalidArgument the gateway answers 422) for a token that is not one of ours, or one that came with
    another filter."""
    if not token:
        return ""
    bad = InvalidPageToken("page_token is not a token this API issued: pass next_page_token of the previous "
                          "page unchanged, or none for the first page")
    if not contract.PAGE_TOKEN.matches(token):
        raise bad
    try:
        body = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
    except (binascii.Error, ValueError):
        raise bad from None
    if not isinstance(body, dict) or body.get("v") != _TOKEN_VERSION or not isinstance(body.get("b"), str):
        raise bad
    if not is_valid_id(body["b"]):
        raise bad
    if body.get("f") != flt.digest():
        raise InvalidPageToken("page_token belongs to a listing with other filters: send the same filters as "
                              "for the first page, or start again without a page_token")
    cursor: str = body["b"]
    return cursor
