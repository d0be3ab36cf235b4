"""JobWatchService.WatchJobs: every live job, then every change, from this replica's mirror of etcd.

The gateway keeps a read view of the live jobs fed by this stream (trainyard_gateway/job_view.py), so that a
GET of a job costs it no round trip to the scheduler. Any replica serves it, leader or standby: every replica
mirrors the job and allocation keys (PrefixMirror), and the stream is read from that copy, never from etcd, so
a thousand gateway reads cost the scheduler nothing and etcd one watch per replica.

One stream: subscribe to the mirror's change set (`PrefixMirror.subscribe`, which starts "everything"), then in
a loop take what changed and the mirror's revision at once (nothing awaits in between, so the two agree):

- everything (the first take, and after the mirror reloaded): a snapshot. The job and allocation records are
  copied out of the mirror in that same step (references to immutable records: the copy is the mirror at that
  revision), then encoded and sent `CHUNK_JOBS` at a time (the first message `reset`, the last `synced`, all at
  that revision) while the mirror moves on; what changes meanwhile is in the change set for the next take.
  The first message carries the history bound: every job in the history store that is not in the snapshot has
  an id at or below `max_job_id`. It is read after the copy, so a job that left etcd before the copy is in
  the history store by then (the archiver writes the history before it deletes from etcd), and one that
  leaves after is reported deleted by a later message.
- some keys: one message with the jobs whose job or allocation record changed, as they are now, and the jobs
  whose record is gone, at the mirror's revision. Changes between two takes fold into the latest state.
- nothing for `PROGRESS_S`: a message with no jobs (progress), so the gateway tells a quiet stream from a dead
  one; and one within `BOOKMARK_S` when only other keys (the audit log, tokens, nodes) moved the revision on,
  so that a reader waiting for a revision (X-Trainyard-Revision) gets there soon.

A job is sent as GetJob answers it (`convert.job_to_pb` with its live allocation while it is placed), decoded
once per pair of record revisions and shared by every stream of this replica.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Collection, Mapping

import grpc.aio

from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_core.store.api import KeyValue
from trainyard_core.store.mirror import PrefixMirror

from ..domain.listing import JobFilter
from ..domain.models import JobState
from ..history.access import History
from ..history.store import HistoryUnavailable
from ..state.codec import decode_allocation, decode_job
from ..state.keys import Keys
from . import convert

log = logging.getLogger(__name__)

CHUNK_JOBS = 500
CHUNK_BYTES = 1 << 20  # far below gRPC's 4 MiB default message limit
PROGRESS_S = 5.0
BOOKMARK_S = 0.1
# The history bound is looked for in this many pages of the newest archived jobs (those still in etcd too are
# skipped); past them the last id read is the bound (every job not in etcd lies below it).
BOUND_PAGES, BOUND_PAGE = 10, 200


class JobWatchServicer(scheduler_pb2_grpc.JobWatchServiceServicer):
    def __init__(self, mirror: PrefixMirror, keys: Keys, history: History | None, *,
                 chunk_jobs: int = CHUNK_JOBS, progress_s: float = PROGRESS_S) -> None:
        self._mirror = mirror
        self._keys = keys
        self._history = history
        self._chunk = chunk_jobs
        self._progress_s = progress_s
        # job id → ((job record revision, allocation record revision), the job as sent), shared by the streams.
        self._encoded: dict[str, tuple[tuple[int, int], scheduler_pb2.WatchedJob]] = {}

    async def WatchJobs(self, request: scheduler_pb2.WatchJobsRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[scheduler_pb2.WatchJobsResponse]:
        changes = self._mirror.subscribe()
        sent_rev, sent_at = -1, time.monotonic()
        while True:
            full, keys = changes.take()
            rev = self._mirror.revision
            if full:
                jobs = dict(self._mirror.under(self._keys.jobs))
                allocs = dict(self._mirror.under(self._keys.allocations))
                async for message in self._snapshot(rev, jobs, allocs):
                    yield message
                sent_rev, sent_at = rev, time.monotonic()
            else:
                message = self._delta(keys, rev)
                idle = time.monotonic() - sent_at
                if (message.jobs or message.deleted or idle >= self._progress_s
                        or (rev > sent_rev and idle >= BOOKMARK_S)):
                    yield message
                    sent_rev, sent_at = rev, time.monotonic()
            # Until the next change, or until a bookmark (the revision moved on unsent) or progress is due.
            due = (BOOKMARK_S if rev > sent_rev else self._progress_s) - (time.monotonic() - sent_at)
            await self._mirror.wait_for(rev + 1, timeout=max(due, 0.005))

    async def _snapshot(self, rev: int, jobs: Mapping[str, KeyValue],
                        allocs: Mapping[str, KeyValue]) -> AsyncIterator[scheduler_pb2.WatchJobsResponse]:
        prefix = self._keys.jobs
        ids = [key[len(prefix):] for key in jobs]
        history = await self._history_bound(frozenset(ids))
        for gone in [i for i in self._encoded if self._keys.job(i) not in jobs]:
            del self._encoded[gone]
        message = scheduler_pb2.WatchJobsResponse(revision=rev, reset=True, history=history)
        size = 0
        for job_id in ids:
            watched = self._encode(job_id, jobs[self._keys.job(job_id)], allocs.get(self._keys.allocation(job_id)))
            message.jobs.append(watched)
            size += watched.ByteSize()
            if len(message.jobs) >= self._chunk or size >= CHUNK_BYTES:
                yield message
                message, size = scheduler_pb2.WatchJobsResponse(revision=rev), 0
        message.synced = True
        yield message

    def _delta(self, keys: Collection[str], rev: int) -> scheduler_pb2.WatchJobsResponse:
        jobs_prefix, alloc_prefix = self._keys.jobs, self._keys.allocations
        touched: set[str] = set()
        for key in keys:
            if key.startswith(jobs_prefix):
                touched.add(key[len(jobs_prefix):])
            elif key.startswith(alloc_prefix):
                touched.add(key[len(alloc_prefix):])
        message = scheduler_pb2.WatchJobsResponse(revision=rev, synced=True)
        items = self._mirror.items
        for job_id in sorted(touched):
            kv = items.get(self._keys.job(job_id))
            if kv is not None:
                message.jobs.append(self._encode(job_id, kv, items.get(self._keys.allocation(job_id))))
            elif self._keys.job(job_id) in keys:  # an allocation key alone says nothing of the job's record
                self._encoded.pop(job_id, None)
                message.deleted.append(job_id)
        return message

    def _encode(self, job_id: str, job_kv: KeyValue, alloc_kv: KeyValue | None) -> scheduler_pb2.WatchedJob:
        """The job as GetJob answers it (servicer.JobServicer._view): with its allocation's exits while placed."""
        stamp = (job_kv.mod_revision, alloc_kv.mod_revision if alloc_kv is not None else 0)
        hit = self._encoded.get(job_id)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        job = decode_job(job_kv.value)
        alloc = None
        if alloc_kv is not None and not job.state.terminal and job.state is not JobState.PENDING:
            alloc = decode_allocation(alloc_kv.value)
        watched = scheduler_pb2.WatchedJob(job=convert.job_to_pb(job, alloc),
                                           exits_from_allocation=bool(not job.exits and alloc and alloc.exits))
        self._encoded[job_id] = (stamp, watched)
        return watched

    async def _history_bound(self, live: frozenset[str]) -> scheduler_pb2.HistoryBound:
        if self._history is None:
            return scheduler_pb2.HistoryBound(enabled=False)
        try:
            store = await self._history.store()
            before = ""
            for _ in range(BOUND_PAGES):
                page = await store.list(JobFilter(), limit=BOUND_PAGE, before=before)
                outside = next((a.job_id for a in page if a.job_id not in live), None)
                if outside is not None:
                    return scheduler_pb2.HistoryBound(enabled=True, known=True, max_job_id=outside)
                if len(page) < BOUND_PAGE:
                    return scheduler_pb2.HistoryBound(enabled=True, known=True, max_job_id="")
                before = page[-1].job_id
            return scheduler_pb2.HistoryBound(enabled=True, known=True, max_job_id=before)
        except HistoryUnavailable as exc:
            log.warning("job watch: the history store cannot be read (%s); the gateway lists with history through "
                        "the scheduler until the next snapshot", exc)
            return scheduler_pb2.HistoryBound(enabled=True, known=False)
