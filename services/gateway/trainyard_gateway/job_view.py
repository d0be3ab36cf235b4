"""The gateway's read view of the live jobs: `GET /v1/jobs/{id}` (and the lists it can answer exactly) without
a round trip to the scheduler per request.

Fed by the scheduler's JobWatchService (job_view_feed.py): a snapshot of every job in etcd at one revision,
then every change, each message at the etcd revision the view is at once it is applied. The view holds each
job as GetJob answers it, turned into the JSON the API sends on its first read and kept (`ViewedJob.body`),
so a read is a dictionary look-up and a write of those bytes.

States: not ready (at start, and from a broken stream until the next snapshot is complete) → ready. A read
that the view cannot answer goes to the scheduler, as every read did before (`None` from `get` and `page`):
the view is not ready, or has not reached the revision the read needs in time, or the job is not live (it
finished and left etcd: the scheduler reads it from its history store), or the list is one the view cannot
know exactly (job_view_pages.py).

Consistency — a read after a successful write sees that write: every write response of the scheduler carries
the etcd revision of the write, and the gateway raises the view's `floor` to it (`wrote`) before it answers
the client. A read waits (at most `wait_s`) until the view has reached the floor and the revision the client
names (`X-Trainyard-Revision`, for clients of several gateway replicas), and goes to the scheduler, which
reads etcd, when it has not: never an older state than the client's own write. Once a wait ran out, reads go
straight to the scheduler until the view catches up (no second wait for the same revision). When the stream
breaks, the floor is raised to the revision the view had reached, so a snapshot from a replica whose mirror
lags is not served until it has caught up (it is built aside and swapped in then): reads never go back in
time across a reconnect.

Team scoping is the scheduler's: a job of another team is not found (404) for a caller scoped to a team.
Changes are also kept, bounded, in `log` (job_view_log.py) for `GET /v1/jobs?watch=true`.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Iterable, Mapping

from google.protobuf.timestamp_pb2 import Timestamp

from trainyard.scheduler.v1 import scheduler_pb2
from trainyard_core.contract import JobState
from trainyard_core.errors import NotFound
from trainyard_scheduler.domain.listing import JobFilter
from trainyard_scheduler.domain.models import Job as ListedJob
from trainyard_scheduler.domain.models import JobSpec, Resources

from . import convert
from .job_view_log import ChangeLog
from .job_view_pages import HistoryState, Page, page

DEFAULT_WAIT_S = 1.0


class ViewedJob:
    """One live job: the JSON bodies the API answers with, and what the listing filter reads.

    Each is made from the job's message when first asked for, and kept: most changes of a job (a submit, its
    pending reason, its admission) are never read before the next replaces them, and turning a message into the
    API's JSON was a tenth of the gateway's CPU in a burst of submits."""

    __slots__ = ("_body", "_list_body", "_listed", "_watched", "id", "team")

    def __init__(self, watched: scheduler_pb2.WatchedJob) -> None:
        self.id: str = watched.job.id
        self.team: str = watched.job.team
        self._watched = watched
        self._body: bytes | None = None
        self._list_body: bytes | None = None
        self._listed: ListedJob | None = None

    @classmethod
    def of(cls, watched: scheduler_pb2.WatchedJob) -> ViewedJob:
        return cls(watched)

    @property
    def body(self) -> bytes:
        """As GET /v1/jobs/{id} answers it (GetJob)."""
        if self._body is None:
            self._body = convert.job_from_pb(self._watched.job).model_dump_json().encode()
        return self._body

    @property
    def list_body(self) -> bytes:
        """As a page of GET /v1/jobs shows it (ListJobs: no exits of the live allocation)."""
        if self._list_body is None:
            if self._watched.exits_from_allocation:
                listed_pb = scheduler_pb2.WatchedJob()
                listed_pb.job.CopyFrom(self._watched.job)
                del listed_pb.job.exits[:]
                self._list_body = convert.job_from_pb(listed_pb.job).model_dump_json().encode()
            else:
                self._list_body = self.body
        return self._list_body

    @property
    def listed(self) -> ListedJob:
        """What the scheduler's listing rules (domain/listing.py) read."""
        if self._listed is None:
            pb = self._watched.job
            spec = JobSpec(name=pb.spec.name, command=(), resources=Resources(nodes=0, gpus_per_node=0),
                           queue=pb.spec.queue, labels=dict(pb.spec.labels))
            # The times as the API shows them (to the nanosecond, not the scheduler's exact float): what a
            # watch's time bounds read; a listing with time bounds is never the view's (job_view_pages.py).
            self._listed = ListedJob(
                id=pb.id, spec=spec, state=JobState(convert.job_state_name(pb.state)), team=pb.team,
                user=pb.user, created_at=_seconds(pb.created_at), updated_at=0.0,
                finished_at=_seconds(pb.finished_at) if pb.HasField("finished_at") else None)
        return self._listed

    def same_as(self, other: ViewedJob) -> bool:
        """Whether the two answer every read alike (the same message)."""
        return self._watched == other._watched


def _seconds(ts: Timestamp) -> float:
    return float(ts.ToNanoseconds()) / 1e9


class _Ids:
    """Job ids in order (ids sort by submission time), globally and per team."""

    def __init__(self, jobs: Iterable[ViewedJob] = ()) -> None:
        self.all: list[str] = []
        self.by_team: dict[str, list[str]] = {}
        for job in jobs:
            self.all.append(job.id)
            self.by_team.setdefault(job.team, []).append(job.id)
        self.all.sort()
        for ids in self.by_team.values():
            ids.sort()

    def add(self, job: ViewedJob) -> None:
        bisect.insort(self.all, job.id)
        bisect.insort(self.by_team.setdefault(job.team, []), job.id)

    def remove(self, job: ViewedJob) -> None:
        for ids in (self.all, self.by_team.get(job.team, [])):
            i = bisect.bisect_left(ids, job.id)
            if i < len(ids) and ids[i] == job.id:
                del ids[i]


class _Snapshot:
    """A snapshot being received (and, once complete, kept current) aside from the view it will replace."""

    def __init__(self, message: scheduler_pb2.WatchJobsResponse) -> None:
        self.jobs: dict[str, ViewedJob] = {}
        self.revision = message.revision
        self.synced = False
        self.history = HistoryState.of(message.history)

    def apply(self, message: scheduler_pb2.WatchJobsResponse) -> None:
        for watched in message.jobs:
            self.jobs[watched.job.id] = ViewedJob.of(watched)
        for job_id in message.deleted:
            self.jobs.pop(job_id, None)
            self.history = self.history.deleted(job_id)
        self.revision = max(self.revision, message.revision)
        self.synced = self.synced or message.synced


class JobView:
    def __init__(self, *, wait_s: float = DEFAULT_WAIT_S, log_size: int = 10_000) -> None:
        self._wait_s = wait_s
        self.ready = False
        self.revision = 0
        self._jobs: dict[str, ViewedJob] = {}
        self._ids = _Ids()
        self._history = HistoryState()
        # Reads need the view at this revision at least: the latest write through this gateway, and the
        # revision reached before the stream last broke.
        self._floor = 0
        # A revision a read waited for in vain: later reads that need it go to the scheduler at once.
        self._gave_up_at = 0
        self._snapshot: _Snapshot | None = None
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self.log = ChangeLog(log_size)
        # What the reads were answered by ("get: view", or why not), counted for the tests.
        self.counts: dict[str, int] = {}

    # --- the feed's side ----------------------------------------------------------------------------------

    def apply(self, message: scheduler_pb2.WatchJobsResponse) -> None:
        """One message of the stream (in order)."""
        if message.reset:
            self._snapshot = _Snapshot(message)
        if self._snapshot is not None:
            self._snapshot.apply(message)
            if self._snapshot.synced and self._snapshot.revision >= max(self.revision, self._floor):
                self._swap(self._snapshot)
                self._snapshot = None
            return
        if not self.ready:
            return  # a change before any snapshot: the stream is not one this view can follow
        for watched in message.jobs:
            self._put(ViewedJob.of(watched), message.revision)
        for job_id in message.deleted:
            self._history = self._history.deleted(job_id)
            old = self._jobs.pop(job_id, None)
            if old is not None:
                self._ids.remove(old)
                self.log.append(message.revision, None, old)
        self._advance(message.revision)

    def lost(self) -> None:
        """The stream broke: answer nothing until a new snapshot has caught up with what was served."""
        self.ready = False
        self._snapshot = None
        self._floor = max(self._floor, self.revision)
        self._wake_waiters(everyone=True)  # reads waiting for the view go to the scheduler now

    def wrote(self, revision: int) -> None:
        """A write through this gateway committed at `revision`: reads from now on must show it."""
        self._floor = max(self._floor, revision)

    def _put(self, job: ViewedJob, revision: int) -> None:
        old = self._jobs.get(job.id)
        self._jobs[job.id] = job
        if old is None:
            self._ids.add(job)
        self.log.append(revision, job, old)

    def _swap(self, snapshot: _Snapshot) -> None:
        old = self._jobs
        if self.log.started:  # the watchers' changes between the two: what differs
            for job_id, job in snapshot.jobs.items():
                before = old.get(job_id)
                if before is None or not before.same_as(job):
                    self.log.append(snapshot.revision, job, before)
            for job_id, before in old.items():
                if job_id not in snapshot.jobs:
                    self.log.append(snapshot.revision, None, before)
        else:
            self.log.start(snapshot.revision)
        self._jobs = snapshot.jobs
        self._ids = _Ids(snapshot.jobs.values())
        self._history = snapshot.history
        self.ready = True
        self._advance(snapshot.revision)

    def _advance(self, revision: int) -> None:
        self.revision = max(self.revision, revision)
        self.log.reached(self.revision)
        self._wake_waiters()

    def _wake_waiters(self, everyone: bool = False) -> None:
        still = []
        for rev, fut in self._waiters:
            if everyone or rev <= self.revision:
                if not fut.done():
                    fut.set_result(None)
            else:
                still.append((rev, fut))
        self._waiters = still

    # --- the readers' side --------------------------------------------------------------------------------

    async def current(self, revision: int = 0) -> bool:
        """Whether the view may answer a read that must show `revision` and every write made through this
        gateway; waits at most `wait_s` for the view to get there."""
        need = max(revision, self._floor)
        if self.ready and self.revision >= need:
            return True
        if not self.ready or need <= self._gave_up_at:
            return False
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((need, fut))
        try:
            await asyncio.wait_for(fut, self._wait_s)
        except TimeoutError:
            self._gave_up_at = max(self._gave_up_at, need)
            return False
        return self.ready and self.revision >= need

    def get(self, job_id: str, team: str) -> ViewedJob | None:
        """The live job (NotFound when it is another team's and `team` is set); None when it is not live: the
        scheduler answers (from its history store, or not found)."""
        job = self._jobs.get(job_id)
        if job is None:
            return None
        if team and job.team != team:
            raise NotFound(f"job {job_id} not found")  # the scheduler's words (GetJob)
        return job

    def page(self, flt: JobFilter, *, before: str, limit: int) -> Page | None:
        """The page ListJobs would answer, or None when the view cannot know it (job_view_pages.py)."""
        ids = self._ids.by_team.get(flt.team, []) if flt.team else self._ids.all
        return page(ids, self._ids.all, self._jobs, flt, before=before, limit=limit, history=self._history)

    def jobs(self) -> Mapping[str, ViewedJob]:
        return self._jobs

    def count(self, outcome: str) -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + 1

