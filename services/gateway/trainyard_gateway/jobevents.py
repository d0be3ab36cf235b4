"""Watching one job (`GET /v1/jobs/{id}/events?watch=true`): the scheduler's WatchJob as server-sent events.

Each change of the job is one `event: job` whose data is the whole job, as `GET /v1/jobs/{id}` answers it
(not a smaller change record: a client then needs no second model, and its new `events` entries, state and
placement are all there). The event's id is a digest of that JSON (`job_event_id`): a job that did not
change in what the API shows sends nothing, and a client that reconnects with its last id as
`Last-Event-ID` gets the job again only if it changed since (WatchJob starts with the job as it is now, so
a resumed stream says where the job is, with every change it missed folded into it; intermediate states
are in its `events`). When the job is terminal, `event: end` with its state follows and the stream closes.

WatchJob ends early when the job leaves etcd for the history store; the job is then read once more (from
the history store) for its end. A scheduler that cannot be reached is asked again with a growing delay
(the keepalive comments keep the connection meanwhile).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

from trainyard_core.contract import JobState
from trainyard_core.errors import NotFound, TrainyardError

from .clients import SchedulerClient
from .clients_streams import watch_job
from .schemas.jobs import Job
from .sse import Event

EVENT_ID_PATTERN = r"^(?:[0-9a-f]{16})?$"
RETRY_MIN_S, RETRY_MAX_S = 0.2, 5.0


def job_json(job: Job) -> dict[str, Any]:
    data: dict[str, Any] = job.model_dump(mode="json")
    return data


def job_event_id(data: dict[str, Any]) -> str:
    """The id of a job event: 16 hex digits of the SHA-256 of its JSON. Pure."""
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def end_event(job: Job, ident: str) -> Event:
    return Event("end", {"state": job.state, "exit_code": job.exit_code, "message": job.message,
                         "finished_at": job.finished_at.isoformat() if job.finished_at else None}, id=ident)


async def job_events(scheduler: SchedulerClient, first: Job, changes: AsyncIterator[Job], *, team: str,
                     last_event_id: str = "") -> AsyncIterator[Event]:
    """`first` (the watch's first answer, read by the route so that a refusal is an HTTP error), then the rest
    of `changes`, and on from a new watch whenever one ends before the job does."""
    last = last_event_id
    job = first
    delay = RETRY_MIN_S
    pending: list[Job] = [first]
    try:
        while True:
            for job in pending:
                data = job_json(job)
                ident = job_event_id(data)
                if ident != last:
                    last = ident
                    yield Event("job", data, id=ident)
                if JobState(job.state).terminal:
                    yield end_event(job, ident)
                    return
            pending = []
            try:
                async for changed in changes:
                    delay = RETRY_MIN_S
                    pending.append(changed)
                    break  # show it before reading the next
                else:
                    # The watch ended before the job did: it left etcd (read its end), or the replica stopped.
                    await _close(changes)
                    pending.append(await scheduler.get_job(job.id, team=team))
                    if not JobState(pending[-1].state).terminal:
                        changes = watch_job(scheduler, job.id, team=team)
            except NotFound:
                yield end_event(job, last)
                return
            except TrainyardError:
                await _close(changes)
                await asyncio.sleep(delay)
                delay = min(RETRY_MAX_S, delay * 2)
                changes = watch_job(scheduler, job.id, team=team)
    finally:
        await _close(changes)


async def _close(changes: AsyncIterator[Job]) -> None:
    closer = getattr(changes, "aclose", None)
    if closer is not None:
        await closer()
