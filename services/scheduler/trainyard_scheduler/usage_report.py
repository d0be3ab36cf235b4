"""Where a usage report's numbers come from (domain/usage.py adds them up): every placed attempt of a job, once.

- running allocations: the replica's mirror of etcd's `allocations/`, each counted from its creation (the
  gang was placed) up to now, accounted to its job's team, user, project label and queue;
- finished attempts of jobs still in etcd: the attempt records of their job records (a running job's earlier
  attempts; a finished job's, until it has left etcd);
- finished attempts of jobs that have left etcd: the history store's usage records (one per attempt, kept
  `history_usage_retention_days`, by default for good).

An attempt can be in two of them at once (a finished job is archived before it leaves etcd; an allocation is
deleted in the transaction that appends its attempt record): it is counted once, from etcd, which is the newer
copy. The mirror is read first, in one step (no await, so at one revision), and `now` is taken with it; the
history after. A job the mirror no longer holds was archived before it left etcd, so the history has it; a job
archived meanwhile was in the mirror. Nothing is counted twice or missed, however the archiver runs meanwhile
(also with job_ttl_s 0).

Any replica answers: the mirror is every replica's, and the history store is shared.
"""

from __future__ import annotations

from trainyard_core.clock import Clock
from trainyard_core.errors import Unavailable
from trainyard_core.store.mirror import PrefixMirror

from .archive import PROJECT_LABEL, usage_of
from .domain.models import Allocation, Job
from .domain.usage import Interval, Pricing, UsageReport, Window, mixed_model, summarize
from .history.access import History
from .history.store import HistoryUnavailable, UsageKey, UsageRecord
from .state.codec import decode_allocation, decode_job
from .state.keys import Keys
from .state.mirrored_nodes import Decoded

HISTORY_PAGE = 10_000


def interval_of(record: UsageRecord) -> Interval:
    return Interval(job_id=record.job_id, attempt=record.attempt, team=record.team, user=record.user,
                    project=record.project, queue=record.queue, model=record.accelerator_model, gpus=record.gpus,
                    cpus=record.cpus, started_at=record.started_at, ended_at=record.ended_at)


def live_interval(alloc: Allocation, job: Job | None) -> Interval:
    """A running allocation as an interval without an end, accounted as its attempt record will be
    (domain.jobs.end_attempt, archive.usage_of). Without its job record (never expected: they are written
    together) it is still counted, for the allocation's team."""
    return Interval(job_id=alloc.job_id, attempt=alloc.attempt, team=job.team if job else alloc.team,
                    user=job.user if job else "", project=job.spec.labels.get(PROJECT_LABEL, "") if job else "",
                    queue=job.spec.queue if job else "", model=mixed_model(a.model for a in alloc.assignments),
                    gpus=alloc.gpus, cpus=sum(a.cpus for a in alloc.assignments), started_at=alloc.created_at,
                    ended_at=None)


def _job_intervals(value: bytes) -> tuple[Job, tuple[Interval, ...]]:
    job = decode_job(value)
    return job, tuple(interval_of(r) for r in usage_of(job))


class MirroredUsage:
    """The intervals the mirror holds, each record decoded once per revision (a report walks every live job)."""

    def __init__(self, mirror: PrefixMirror, keys: Keys) -> None:
        self._keys = keys
        # By etcd key: the job, and its finished attempts as intervals.
        self._jobs = Decoded(mirror, keys.jobs, _job_intervals)
        self._allocs = Decoded(mirror, keys.allocations, decode_allocation)

    def intervals(self) -> list[Interval]:
        """Every running allocation and every finished attempt recorded in a live job record. Synchronous on
        purpose: what it returns is the mirror at one revision."""
        jobs = self._jobs.current()
        out: list[Interval] = [i for _, done in jobs.values() for i in done]
        for alloc in self._allocs.current().values():
            owner = jobs.get(self._keys.job(alloc.job_id))
            out.append(live_interval(alloc, owner[0] if owner else None))
        return out


class UsageReader:
    """Usage reports of one replica (see the module's docstring). `history` None: no history store, finished
    jobs never leave etcd, and the mirror has everything."""

    def __init__(self, mirror: PrefixMirror, keys: Keys, *, history: History | None, pricing: Pricing,
                 clock: Clock) -> None:
        self._mirrored = MirroredUsage(mirror, keys)
        self._history = history
        self.pricing = pricing
        self._clock = clock

    async def report(self, window: Window, group_by: str, *, team: str = "") -> tuple[UsageReport, float]:
        """The report of `team`'s ('' every team's) use in `window`, and the time running allocations are
        counted up to. Unavailable while the history store cannot be read."""
        now = self._clock.now()
        in_etcd = [i for i in self._mirrored.intervals() if not team or i.team == team]
        counted = {(i.job_id, i.attempt) for i in in_etcd}
        archived = [i for i in await self._archived(window, team) if (i.job_id, i.attempt) not in counted]
        return summarize([*in_etcd, *archived], window, group_by, self.pricing, now), now

    async def _archived(self, window: Window, team: str) -> list[Interval]:
        """The history store's usage records that overlap `window`, page by page."""
        if self._history is None or window.end <= window.start:
            return []
        out: list[Interval] = []
        after: UsageKey | None = None
        try:
            store = await self._history.store()
            while True:
                page = await store.usage(team=team, since=window.start, until=window.end, limit=HISTORY_PAGE,
                                         after=after)
                out += (interval_of(r) for r in page)
                if len(page) < HISTORY_PAGE:
                    return out
                after = page[-1].key
        except HistoryUnavailable as exc:
            raise Unavailable(f"the usage of finished allocations is read from the history store, which cannot be "
                              f"read now: {exc}; retry") from None
