"""The gateway's streams as pure builders of `StreamCall`s: each names its request and how its server-sent events
become the gateway's models (`trainyard_gateway.schemas.logs`, `.streams`, `.jobs`).

- `follow_logs(job_id, ...)`: `GET /v1/jobs/{id}/logs?follow=true`: `LineEvent` per line, `WarningEvent` for a
  node that cannot be read for now (the stream goes on), `EndEvent` last, when the job (or the attempt asked
  for) has ended and every node drained.
- `watch_job(job_id)`: `GET /v1/jobs/{id}/events?watch=true`: the whole `Job` now and after every change, then
  `JobEnd` once it has ended.
- `watch_jobs(...)`: `GET /v1/jobs?watch=true`: the live jobs a listing filter selects, as they change: a
  `JobsSnapshot` first (forget what you hold: the `jobs` `JobChanged` that follow are every selected job), then
  a `JobChanged` per change (`deleted`: the job left etcd, finished and archived). Another snapshot may come
  when the gateway cannot replay what the client missed (`reason` says why).

Every stream resumes by itself after a dropped connection (streaming.py): the gateway's event ids are
positions (logs) or digests (a job), sent back as Last-Event-ID. `last_event_id=` starts a new stream after an
event an earlier one saw (its `last_event_id`). An event of a kind this SDK does not know is passed over, so a
newer gateway's additions do not break an older client.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from trainyard_gateway.schemas.jobs import Job
from trainyard_gateway.schemas.logs import EndEvent, LineEvent, WarningEvent
from trainyard_gateway.schemas.streams import JobEnd

from .errors import ProtocolError
from .request_parts import Time, labels, query, segment
from .sse import SseEvent
from .wire import Request, StreamCall

M = TypeVar("M", bound=BaseModel)
END = "end"


class JobsSnapshot(BaseModel):
    """`event: snapshot` of a jobs watch: the `jobs` JobChanged events that follow are every live job the filter
    selects at etcd revision `revision`; drop what was held before."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    revision: int
    jobs: int
    reason: str = ""


class JobChanged(BaseModel):
    """`event: job` of a jobs watch: the job as `GET /v1/jobs/{id}` answers it; `deleted` once it has left etcd
    (finished and archived; `get_job` still answers it, from the history)."""

    model_config = ConfigDict(frozen=True)

    job: Job
    deleted: bool


LogEvent = LineEvent | WarningEvent | EndEvent
JobChange = Job | JobEnd
JobsChange = JobsSnapshot | JobChanged


def _parse(cls: type[M], event: SseEvent) -> M:
    try:
        return cls.model_validate_json(event.data, extra="ignore")
    except ValidationError as exc:
        raise ProtocolError(f"a {event.event!r} event of the stream is not a {cls.__name__}: "
                            f"{exc.errors()[0].get('msg', 'invalid')}") from None


def _log_event(event: SseEvent) -> LogEvent | None:
    cls = _LOG_KINDS.get(event.event)
    return None if cls is None else _parse(cls, event)


def _job_change(event: SseEvent) -> JobChange | None:
    cls = _JOB_KINDS.get(event.event)
    return None if cls is None else _parse(cls, event)


def _jobs_change(event: SseEvent) -> JobsChange | None:
    if event.event == "snapshot":
        return _parse(JobsSnapshot, event)
    if event.event == "job":
        return JobChanged(job=_parse(Job, event), deleted=_deleted(event))
    return None


def _deleted(event: SseEvent) -> bool:
    try:
        return json.loads(event.data).get("deleted") is True
    except (ValueError, AttributeError):
        return False


def _is_end(event: SseEvent) -> bool:
    return event.event == END


_LOG_KINDS: Mapping[str, type[LineEvent] | type[WarningEvent] | type[EndEvent]] = {
    "line": LineEvent, "warning": WarningEvent, END: EndEvent}
_JOB_KINDS: Mapping[str, type[Job] | type[JobEnd]] = {"job": Job, END: JobEnd}


def follow_logs(job_id: str, *, tail: int = 0, attempt: int | None = None, rank: int | Sequence[int] | None = None,
                since: Time | None = None, last_event_id: str = "") -> StreamCall[LogEvent]:
    """Follow a job's output: each line as it is printed (`LineEvent`: rank, attempt, node, stream, text), a
    `WarningEvent` for a node that cannot be read for now, and `EndEvent` (the job's final state) last. `tail`:
    start with the last N lines of each rank (0: all kept); `attempt`: only that one (default: the current
    attempt and every later one, across restarts; 0: every attempt); `rank`: only these ranks; `since`: leave
    out the attempts that ended before it."""
    params = query(follow=True, tail=tail, attempt=attempt, rank=rank, since=since)
    request = Request("GET", f"/v1/jobs/{segment('job_id', job_id)}/logs", params=tuple(params))
    return StreamCall(request, _log_event, final=_is_end, last_event_id=last_event_id)


def watch_job(job_id: str, *, last_event_id: str = "") -> StreamCall[JobChange]:
    """Watch one job: the whole `Job` now and after each change, then `JobEnd` once it has ended."""
    request = Request("GET", f"/v1/jobs/{segment('job_id', job_id)}/events", params=(("watch", "true"),))
    return StreamCall(request, _job_change, final=_is_end, last_event_id=last_event_id)


def watch_jobs(*, state: str | Sequence[str] | None = None, team: str = "", user: str = "", queue: str = "",
               label: Mapping[str, str] | Sequence[str] | None = None, name_prefix: str = "",
               last_event_id: str = "") -> StreamCall[JobsChange]:
    """Watch the live jobs these filters select (`list_jobs`'s, without time bounds): a `JobsSnapshot` and every
    selected job as a `JobChanged`, then a `JobChanged` per change. It lasts until it is closed."""
    params = query(watch=True, state=state, team=team, user=user, queue=queue, label=labels(label),
                   name_prefix=name_prefix)
    request = Request("GET", "/v1/jobs", params=tuple(params))
    return StreamCall(request, _jobs_change, last_event_id=last_event_id)
