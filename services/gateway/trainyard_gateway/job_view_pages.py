"""Which pages of GET /v1/jobs the read view answers, and how: pure functions over the view's live jobs.

The view must answer exactly what the scheduler's ListJobs would (the same jobs, the same order, the same
`next_page_token`, so that a client may page on through either), or not at all (None: the scheduler answers).
ListJobs (trainyard_scheduler/grpc/servicer.py) is, for a filter F, a cursor C and a page size L:

- the live part: the first L live jobs matching F with ids below C, newest first (job id descending), and
  "more" when any live job, of any team, has an id below the last of them (etcd's range had more keys);
- when the scheduler has a history store and F can match finished jobs (no state filter, or one naming a
  terminal state): merged with the first L finished jobs of the history store matching F below C (a job in
  both shown as etcd has it), the first L of the union, and "more" also when the history gave L, or the
  union held more than L.

The view knows the live part (every live job is in it) but not the history store. What it knows of the
history is its bound (HistoryState): every job in the history store that is not live has an id at or below
`max_job_id` — read by the scheduler when the snapshot was taken, and raised by every job the stream
reports deleted (the archiver writes a job to the history before it deletes it from etcd). So a merged page
is known when at least L+1 live jobs matching F lie above the bound below C: no job of the history that is
not live can come before them, the first L of them are the page, and "more" is true (the union holds more
than L). Otherwise (a team's or a filter's few jobs, or a page that reaches down to the bound) the
scheduler answers. Listings with time bounds always go to the scheduler: the view does not keep the jobs'
times at the precision the scheduler compares them at. Without a history store (jobs never leave etcd),
every listing without time bounds is the live part alone, and the view answers it.

The filter, its checks and the page tokens are the scheduler's own (domain/listing.py), imported, not
copied: the view cannot drift from what ListJobs matches or from the tokens it issues and accepts.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainyard.scheduler.v1 import scheduler_pb2
from trainyard_scheduler.domain.listing import JobFilter, matches

if TYPE_CHECKING:
    from .job_view import ViewedJob


@dataclass(frozen=True, slots=True)
class HistoryState:
    """What a listing merges in besides the live jobs. `enabled`: the scheduler has a history store; `known`:
    its bound could be read; `max_job_id`: every job of the history store that is not live has an id at or
    below it ('' : there is none)."""

    enabled: bool = False
    known: bool = False
    max_job_id: str = ""

    @classmethod
    def of(cls, pb: scheduler_pb2.HistoryBound) -> HistoryState:
        return cls(enabled=pb.enabled, known=pb.known, max_job_id=pb.max_job_id)

    def deleted(self, job_id: str) -> HistoryState:
        """A job left etcd: it is in the history store now."""
        if not self.enabled or job_id <= self.max_job_id:
            return self
        return HistoryState(enabled=True, known=self.known, max_job_id=job_id)


@dataclass(frozen=True, slots=True)
class Page:
    jobs: list[ViewedJob]
    more: bool


def has_time_bounds(flt: JobFilter) -> bool:
    return any(b is not None for b in (flt.submitted_after, flt.submitted_before, flt.finished_after,
                                       flt.finished_before))


def page(candidates: Sequence[str], all_ids: Sequence[str], jobs: Mapping[str, ViewedJob], flt: JobFilter, *,
         before: str, limit: int, history: HistoryState) -> Page | None:
    """The page ListJobs answers for `flt` below the cursor `before` ('' : from the newest), or None when the
    view cannot know it. `candidates`: the ids that may match, in ascending order (the team's, for a filter
    with a team); `all_ids`: every live job's id, in ascending order."""
    if has_time_bounds(flt):
        return None
    merged = history.enabled and flt.needs_history
    if merged and not history.known:
        return None
    want = limit + 1 if merged else limit
    end = bisect.bisect_left(candidates, before) if before else len(candidates)
    found: list[ViewedJob] = []
    for i in range(end - 1, -1, -1):
        job_id = candidates[i]
        if merged and job_id <= history.max_job_id:
            break  # jobs of the history store that are not live may lie between the ones below
        job = jobs[job_id]
        if matches(job.listed, flt):
            found.append(job)
            if len(found) == want:
                break
    if merged:
        return Page(found[:limit], more=True) if len(found) == want else None
    if len(found) < limit:
        return Page(found, more=False)
    return Page(found, more=bisect.bisect_left(all_ids, found[-1].id) > 0)
