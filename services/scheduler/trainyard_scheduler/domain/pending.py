"""The queue as the leader's last scheduling cycle saw it: pending jobs in order, each with why it waits.

A cycle (`policy.place`) considers pending jobs one at a time in the order the profile's `QueueOrder` gives
(queue tier, priority class, priority, then fair share and submission time, re-ranked as the session hands out
GPUs): that order is the queue. `pending_order` keeps it, less the jobs the cycle placed, so a user can be told
"3rd of 12 in queue gpu, waiting for 8 free GPUs" (Slurm's squeue with its Reason column; Kueue's pending
workloads). Held jobs are not considered, so they have no position; they follow, oldest first, with the hold
as their reason. A job submitted after the cycle is not in it yet (the next cycle, which its submit wakes,
has it). Positions are as of the cycle (`as_of`): they move as other jobs are placed, submitted or held.

Pure: built from the cycle's snapshot and result; `select` answers one caller's question from it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .models import Job, JobState
from .operations import WAITING_MESSAGE

# A job the cycle considered but found no reason for (should not happen: every unplaced job has one).
NO_REASON = WAITING_MESSAGE


@dataclass(frozen=True, slots=True)
class PendingEntry:
    job_id: str
    team: str
    user: str
    queue: str
    # 1-based place in its queue among the jobs the cycle considered; 0 for a held job (not considered).
    position: int
    reason: str
    held: bool
    queued_at: float


@dataclass(frozen=True, slots=True)
class PendingOrder:
    """`entries`: the considered jobs in the cycle's order, then the held ones. `lengths`: jobs with a position
    per queue."""

    as_of: float
    entries: tuple[PendingEntry, ...]
    lengths: Mapping[str, int]


EMPTY = PendingOrder(as_of=0.0, entries=(), lengths={})


def _entry(job: Job, position: int, reason: str) -> PendingEntry:
    return PendingEntry(job_id=job.id, team=job.team, user=job.user, queue=job.spec.queue, position=position,
                        reason=reason or NO_REASON, held=bool(job.held_by),
                        queued_at=job.queued_at or job.created_at)


def pending_order(jobs: Mapping[str, Job], considered: Iterable[str], placed: Iterable[str],
                  reasons: Mapping[str, str], as_of: float) -> PendingOrder:
    """The order of a cycle over `jobs` (its snapshot's): `considered` in the cycle's order, less `placed`
    (its decisions); `reasons` per job (its unplaced and preemption reasons; the job's message otherwise)."""
    gone = set(placed)
    entries: list[PendingEntry] = []
    lengths: dict[str, int] = {}
    for job_id in considered:
        job = jobs.get(job_id)
        if job is None or job_id in gone:
            continue
        queue = job.spec.queue
        lengths[queue] = lengths.get(queue, 0) + 1
        entries.append(_entry(job, lengths[queue], reasons.get(job_id) or job.message))
    held = sorted((j for j in jobs.values() if j.state is JobState.PENDING and j.held_by and not j.cancel_requested),
                  key=lambda j: (j.queued_at or j.created_at, j.id))
    entries.extend(_entry(j, 0, j.message) for j in held)
    return PendingOrder(as_of=as_of, entries=tuple(entries), lengths=lengths)


def select(order: PendingOrder, *, team: str = "", queue: str = "", job_id: str = "",
           limit: int) -> tuple[list[PendingEntry], int]:
    """The entries one caller asked for, in order, at most `limit`, and how many matched in all. `team`: only
    that team's jobs ("" every team's: operators); positions still count every team's jobs ahead."""
    matched = [e for e in order.entries if (not team or e.team == team) and (not queue or e.queue == queue)
               and (not job_id or e.job_id == job_id)]
    return matched[:limit], len(matched)
