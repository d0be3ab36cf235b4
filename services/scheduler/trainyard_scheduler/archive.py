"""Finished jobs leave etcd for the history store (issue 14): etcd holds what is live, SQL what happened.

The leader runs one `Archiver` per term, beside its reconciler. It follows the etcd mirror's job keys (the
keys that changed, or everything after a reload) and keeps the finished jobs it has yet to deal with:

1. archive: a finished job whose record is not marked as archived as it is now is written to the history
   store (the job, with its environment's values left out, and one usage record per placed attempt), a
   batch per transaction.
   The store's write is idempotent by job and attempt;
2. mark: the job's etcd record gets `archived_at` and a digest of what was archived (a compare-and-swap on
   its revision, fenced by the leader's epoch). A crash, a lost leadership or a conflict between 1 and 2
   only means 1 is repeated, by this leader or the next: every finished job is in the history exactly
   once, none is lost. A write to the record after the mark (a rank's exit reported late) leaves the digest
   behind the record's content, so the job is archived again, whoever wrote it and whichever leader sees it;
3. expire: an archived job whose end is `job_ttl_s` old leaves etcd (compare-and-swap on the revision seen,
   fenced), so watchers and the gateway see the end for that long; reads find it in the history after.

4. prune (only with a retention set, `job_retention_s` or `usage_retention_s`): at most once per
   `prune_interval_s` (an hour), the history store deletes the job rows and usage records older than their
   retention, `prune_batch` rows per transaction and at most `prune_batches` transactions of each kind per
   pass, so archiving gets its turn in between; what is left goes on at the next pass. Its failures are
   counted and logged like archiving's, and wait for the next interval: retention is measured in days.

A history store that cannot be reached delays 1 (and so 2 and 3): jobs stay in etcd, a bounded backlog (the
finished jobs, which take no part in scheduling), `trainyard_scheduler_history_backlog_jobs` says how many,
and one warning per outage says why. Scheduling never waits for it: the archiver has its own task and its
own pace, and a reconcile cycle never reads finished jobs (state/snapshots.py drops them).
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from trainyard_core.clock import Clock
from trainyard_core.errors import Conflict, Unavailable
from trainyard_core.logs import log_context
from trainyard_core.store.mirror import PrefixMirror
from trainyard_core.waits import completes_within

from . import metrics
from .domain.models import Job
from .history.access import History
from .history.store import ArchivedJob, HistoryUnavailable, Pruned, UsageRecord
from .state.codec import decode_job, encode_job
from .state.repository import Repository

log = logging.getLogger(__name__)

# The job label usage records are grouped by as the "project" (Slurm's account, Determined's workspace).
PROJECT_LABEL = "project"


@dataclass(frozen=True, slots=True)
class ArchiveSettings:
    job_ttl_s: float = 3600.0     # a finished job stays in etcd this long after it ended (once archived)
    batch: int = 200              # jobs per history transaction
    interval_s: float = 1.0       # how often the archiver looks, at most
    retry_s: float = 5.0          # after a history store error
    job_retention_s: float = 0.0     # job rows leave the history store this long after they ended; 0: kept
    usage_retention_s: float = 0.0   # usage records, this long after the allocation ended; 0: kept
    prune_interval_s: float = 3600.0  # how often the leader prunes, at most (with a retention set)
    prune_batch: int = 1000           # rows per prune transaction
    prune_batches: int = 10           # transactions of each kind per pass; then archiving gets its turn

    @property
    def prunes(self) -> bool:
        return self.job_retention_s > 0 or self.usage_retention_s > 0


def content_digest(job: Job) -> str:
    """A digest of what the history keeps of the job (the record without the archive's own marks)."""
    return hashlib.sha256(encode_job(replace(job, archived_at=None, archived_digest=""))).hexdigest()[:24]


def is_archived(job: Job) -> bool:
    """Whether the history store holds the job as it is now: marked, and unchanged since (a record marked by
    an earlier version, without a digest, counts as archived)."""
    return job.archived_at is not None and job.archived_digest in ("", content_digest(job))


def redacted(job: Job) -> Job:
    """The job as the history keeps it: its environment's names, not their values (they may be secrets)."""
    if not job.spec.env:
        return job
    return replace(job, spec=replace(job.spec, env={name: "" for name in job.spec.env}))


def usage_of(job: Job) -> tuple[UsageRecord, ...]:
    """One usage record per placed attempt of the job."""
    project = job.spec.labels.get(PROJECT_LABEL, "")
    return tuple(UsageRecord(job_id=job.id, attempt=a.attempt, team=job.team, user=job.user, project=project,
                             queue=job.spec.queue, accelerator_model=a.model, gpus=a.gpus, cpus=a.cpus,
                             nodes=len(a.nodes), started_at=a.started_at, ended_at=a.ended_at)
                 for a in job.attempts)


def archived(job: Job) -> ArchivedJob:
    """What the history store keeps of a finished job."""
    assert job.finished_at is not None, job.id
    return ArchivedJob(job_id=job.id, team=job.team, user=job.user, name=job.spec.name, queue=job.spec.queue,
                       state=job.state.value, labels=dict(job.spec.labels), submitted_at=job.created_at,
                       finished_at=job.finished_at, record=encode_job(redacted(job)), usage=usage_of(job))


class Archiver:
    """Archives and expires the finished jobs of one leader's term (see the module's docstring)."""

    def __init__(self, *, repo: Repository, mirror: PrefixMirror, history: History, clock: Clock,
                 settings: ArchiveSettings, leading: Callable[[], bool] = lambda: True) -> None:
        self._repo = repo
        self._mirror = mirror
        self._history = history
        self._clock = clock
        self._s = settings
        self._leading = leading
        self._changes = mirror.subscribe()
        # Finished jobs not archived yet: job id → revision of the record seen.
        self._unarchived: dict[str, int] = {}
        # Archived jobs by when they expire: (expiry, job id, revision); stale entries are skipped.
        self._expiring: list[tuple[float, str, int]] = []
        self._failing = False
        # When the next prune pass is due (monotonic); a term prunes at its first pass.
        self._next_prune = clock.monotonic()
        # What the prune in progress (over several passes, when it has much to delete) has deleted so far.
        self._pruning = Pruned(0, 0)

    @property
    def backlog(self) -> int:
        return len(self._unarchived)

    def _refresh(self) -> None:
        """Bring the finished jobs in view up to the mirror: only the job keys that changed."""
        full, keys = self._changes.take()
        prefix = self._repo.keys.jobs
        items = self._mirror.items
        if full:
            self._unarchived.clear()
            self._expiring.clear()
            keys = set(self._mirror.under(prefix))
        for key in keys:
            if not key.startswith(prefix):
                continue
            job_id = key[len(prefix):]
            self._unarchived.pop(job_id, None)
            kv = items.get(key)
            if kv is None:
                continue
            job = decode_job(kv.value)
            if not job.state.terminal or job.finished_at is None:
                continue
            if not is_archived(job):
                self._unarchived[job_id] = kv.mod_revision
            else:
                heapq.heappush(self._expiring, (job.finished_at + self._s.job_ttl_s, job_id, kv.mod_revision))
        metrics.HISTORY_BACKLOG.set(len(self._unarchived))

    def _current(self, job_id: str, revision: int) -> Job | None:
        """The job as the mirror has it, if still at `revision`."""
        kv = self._mirror.items.get(self._repo.keys.job(job_id))
        if kv is None or kv.mod_revision != revision:
            return None
        return decode_job(kv.value)

    async def step(self) -> int:
        """One pass: archive a batch, mark it, expire what is due. Returns how many jobs it changed in etcd.
        HistoryUnavailable propagates (the caller waits and retries)."""
        self._refresh()
        changed = 0
        batch: list[tuple[Job, int]] = []
        for job_id, rev in list(self._unarchived.items())[: self._s.batch]:
            job = self._current(job_id, rev)
            if job is not None:
                batch.append((job, rev))
        if batch:
            store = await self._history.store()
            await store.archive([archived(job) for job, _ in batch])
            metrics.HISTORY_ARCHIVED.inc(len(batch))
            now = self._clock.now()
            for job, rev in batch:
                if not self._leading():
                    return changed
                try:
                    await self._repo.update_job(replace(job, archived_at=now, archived_digest=content_digest(job)),
                                                rev)
                except Conflict:
                    continue  # changed meanwhile (or leadership lost): seen again through the mirror
                self._unarchived.pop(job.id, None)
                changed += 1
            metrics.HISTORY_BACKLOG.set(len(self._unarchived))
        changed += await self._expire()
        return changed

    async def _expire(self) -> int:
        now = self._clock.now()
        done = 0
        while self._expiring and self._expiring[0][0] <= now and self._leading():
            _, job_id, rev = heapq.heappop(self._expiring)
            job = self._current(job_id, rev)
            if job is None:
                continue  # gone already, or changed (its new revision is queued anew)
            try:
                await self._repo.delete_job(job, rev)
            except Conflict:
                continue
            done += 1
            metrics.JOBS_EXPIRED.inc()
            with log_context(job_id=job_id):
                log.info("finished job left etcd", extra={"state": job.state.value, "ttl_s": self._s.job_ttl_s})
        return done

    async def prune(self) -> Pruned | None:
        """A prune pass if one is due (see the module docstring): what it deleted, or None when none was due or
        it failed. Never raises: a failure is counted (trainyard_scheduler_history_errors_total), logged, and
        tried again at the next interval."""
        s = self._s
        if not s.prunes or self._clock.monotonic() < self._next_prune or not self._leading():
            return None
        self._next_prune = self._clock.monotonic() + s.prune_interval_s
        now = self._clock.now()
        try:
            store = await self._history.store()
            pruned = await store.prune(jobs_before=now - s.job_retention_s if s.job_retention_s > 0 else None,
                                       usage_before=now - s.usage_retention_s if s.usage_retention_s > 0 else None,
                                       batch=s.prune_batch, max_batches=s.prune_batches)
        except (HistoryUnavailable, Unavailable) as exc:
            metrics.HISTORY_ERRORS.inc()
            log.warning("cannot prune the history store: %s; trying again in %gs", exc, s.prune_interval_s)
            return None
        except Exception:  # a bug here must not end archiving for the term
            log.exception("pruning the history store failed; trying again in %gs", s.prune_interval_s)
            return None
        metrics.HISTORY_PRUNED.labels(kind="job").inc(pruned.jobs)
        metrics.HISTORY_PRUNED.labels(kind="usage").inc(pruned.usage)
        self._pruning = Pruned(self._pruning.jobs + pruned.jobs, self._pruning.usage + pruned.usage)
        budget = s.prune_batch * s.prune_batches
        if pruned.jobs >= budget or pruned.usage >= budget:
            self._next_prune = self._clock.monotonic()  # more to delete: go on at the next pass
        else:
            log.info("pruned the history store", extra={
                "jobs_pruned": self._pruning.jobs, "usage_pruned": self._pruning.usage,
                "job_retention_days": s.job_retention_s / 86400, "usage_retention_days": s.usage_retention_s / 86400})
            self._pruning = Pruned(0, 0)
        return pruned

    async def run(self, stop: asyncio.Event) -> None:
        """Until `stop`: a pass whenever the mirror changes, at most every interval_s; after a history store
        error, again retry_s later (one warning per outage, one info line when it is back). After each pass
        that reached the store, a prune pass when one is due (`prune`)."""
        while not stop.is_set():
            wait = self._s.interval_s
            try:
                await self.step()
                if self._failing:
                    self._failing = False
                    log.info("history store reachable again; archiving resumed", extra={"backlog": self.backlog})
            except (HistoryUnavailable, Unavailable) as exc:
                metrics.HISTORY_ERRORS.inc()
                if not self._failing:
                    self._failing = True
                    log.warning("cannot archive finished jobs: %s; they stay in etcd until the history store "
                                "answers (backlog: %d)", exc, self.backlog)
                wait = self._s.retry_s
            except Exception:  # a bug here must not end archiving for the term
                log.exception("archiving pass failed; trying again")
                wait = self._s.retry_s
            if not self._failing:  # while archiving cannot reach the store, neither could a prune
                await self.prune()
            await completes_within(stop.wait(), wait)


__all__: Sequence[str] = ["ArchiveSettings", "Archiver", "archived", "redacted", "usage_of"]
