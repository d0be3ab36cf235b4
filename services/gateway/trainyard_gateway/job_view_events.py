"""`GET /v1/jobs?watch=true`: the changes of the live jobs a listing filter selects, as server-sent events from
the read view (job_view.py, its change log job_view_log.py), in the gateway's one SSE format (sse.py).

The stream:

- `event: snapshot`, data `{"revision": R, "jobs": N, "reason": "..."}`: forget what you hold; the N `job`
  events that follow are every live job the filter selects at revision R (newest first). Sent first, unless
  the client resumes (`Last-Event-ID`) from a revision the view can still replay; and again, with its reason,
  when the client's revision is older than what the view keeps ("resume point too old") or the client fell so
  far behind that changes it had not read were dropped ("fell behind").
- `event: job`, data: the job as GET /v1/jobs/{id} answers it, plus `"deleted": false`; or, for a job that left
  etcd (finished and archived: GET still answers it, from the history), its last state with
  `"deleted": true`. After the snapshot, one event per change of a job that the filter selects before or after
  the change (so a job that stops matching, e.g. leaves the `state` asked for, is seen leaving). Changes of
  one job between two messages of the scheduler's stream fold into its latest state.
- `id: R` on the last event of each etcd revision: the client's `Last-Event-ID`. A resumed stream sends every
  change after R (a revision's events are resent whole when the connection dropped inside them).

Team scoping as the list: a caller scoped to a team sees only that team's jobs. Ids are etcd revisions, the
same on every gateway replica, so a client may resume on another one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

import orjson

from trainyard_scheduler.domain.listing import JobFilter, matches

from .job_view import JobView, ViewedJob
from .job_view_log import Change
from .sse import Event

# How long one wait for the next change lasts; the SSE helper sends keepalives meanwhile.
WAIT_S = 30.0


def _data(job: ViewedJob, deleted: bool) -> dict[str, Any]:
    data: dict[str, Any] = orjson.loads(job.body)
    data["deleted"] = deleted
    return data


def _selects(flt: JobFilter | None, job: ViewedJob) -> bool:
    """None: the filter of a watch nothing matches (another team's, labels no job can have)."""
    return flt is not None and matches(job.listed, flt)


def selected(change: Change, flt: JobFilter | None) -> bool:
    """Whether a watcher with this filter hears of the change: the job matched before or matches after."""
    return any(j is not None and _selects(flt, j) for j in (change.job, change.before))


def events_of(changes: Iterable[Change], flt: JobFilter | None) -> list[Event]:
    """The events of these changes (whole revisions, in order) for `flt`; the last one of each revision carries
    the revision as its id."""
    out: list[Event] = []
    group: list[Event] = []
    revision = None
    for change in changes:
        if change.revision != revision:
            _close_group(out, group, revision)
            group, revision = [], change.revision
        if selected(change, flt):
            group.append(Event("job", _data(change.current, deleted=change.job is None)))
    _close_group(out, group, revision)
    return out


def _close_group(out: list[Event], group: list[Event], revision: int | None) -> None:
    if group and revision is not None:
        group[-1] = Event(group[-1].kind, group[-1].data, id=str(revision))
    out.extend(group)


def _snapshot(view: JobView, flt: JobFilter | None, reason: str) -> tuple[list[Event], int]:
    """The snapshot's events, and the log position after it (read in the same step: nothing in between)."""
    jobs = sorted((j for j in view.jobs().values() if _selects(flt, j)), key=lambda j: j.id, reverse=True)
    revision = view.revision
    events = [Event("snapshot", {"revision": revision, "jobs": len(jobs), "reason": reason})]
    events += [Event("job", _data(j, deleted=False)) for j in jobs]
    last = events[-1]
    events[-1] = Event(last.kind, last.data, id=str(revision))
    return events, view.log.next_seq


async def watch(view: JobView, flt: JobFilter | None, resume_after: int | None) -> AsyncIterator[Event]:
    """The watch stream (see the module docstring). The view must be ready when it begins."""
    if resume_after is not None and view.log.replayable(resume_after):
        seq = view.log.seq_after(resume_after)
    else:
        reason = "start" if resume_after is None else "resume point too old"
        events, seq = _snapshot(view, flt, reason)
        for event in events:
            yield event
    while True:
        changes = view.log.since(seq)
        if changes is None:
            events, seq = _snapshot(view, flt, "fell behind")
            for event in events:
                yield event
            continue
        if not changes:
            await view.log.wait(seq, WAIT_S)
            continue
        seq = changes[-1].seq + 1
        for event in events_of(changes, flt):
            yield event
