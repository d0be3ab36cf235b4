"""Job lifecycle.

States and transitions (who writes them; every write is one etcd transaction guarded by the job's mod
revision and, for the scheduler's own writes, by the leader's epoch):

    PENDING   --place (leader: job + allocation in one txn)-->               ADMITTED
    ADMITTED  --every node's agent confirmed the launch (leader)-->          RUNNING
    RUNNING   --every rank exited 0 (leader, allocation deleted)-->          SUCCEEDED
    ADMITTED/RUNNING --a rank failed / launch refused / node lost: workers stopped,
                       then allocation deleted (leader)-->                   FAILED
    PENDING   --cancel (any replica, CAS on the job)-->                      CANCELLED
    ADMITTED/RUNNING --cancel sets cancel_requested (any replica); the leader stops the
                       workers, deletes the allocation-->                    CANCELLED
    PREEMPTED / RESTARTING: reserved for preemption and restart policies (later issues).

SUCCEEDED, FAILED and CANCELLED are terminal: nothing leaves them. An allocation exists exactly while a
job is ADMITTED or RUNNING, or is being stopped on its way to a terminal state.
"""

from __future__ import annotations

from dataclasses import replace

from trainyard_core.errors import FailedPrecondition

from .models import Job, JobEvent, JobState, NodeAssignment, WorkerExit

_ALLOWED: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.ADMITTED, JobState.CANCELLED, JobState.FAILED}),
    JobState.ADMITTED: frozenset({JobState.RUNNING, JobState.FAILED, JobState.CANCELLED,
                                  JobState.SUCCEEDED, JobState.PREEMPTED, JobState.RESTARTING}),
    JobState.RUNNING: frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED,
                                 JobState.PREEMPTED, JobState.RESTARTING}),
    JobState.PREEMPTED: frozenset({JobState.PENDING, JobState.CANCELLED}),
    JobState.RESTARTING: frozenset({JobState.PENDING, JobState.FAILED, JobState.CANCELLED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}

MAX_EVENTS = 50


def can_transition(src: JobState, dst: JobState) -> bool:
    return dst in _ALLOWED[src]


def with_event(job: Job, now: float, kind: str, message: str) -> Job:
    events = (*job.events, JobEvent(at=now, kind=kind, message=message))[-MAX_EVENTS:]
    return replace(job, events=events, updated_at=now)


def transition(job: Job, dst: JobState, now: float, message: str) -> Job:
    if not can_transition(job.state, dst):
        raise FailedPrecondition(f"job {job.id} cannot go from {job.state} to {dst}")
    changed = replace(job, state=dst, message=message)
    if dst is JobState.RUNNING and job.started_at is None:
        changed = replace(changed, started_at=now)
    if dst.terminal:
        changed = replace(changed, finished_at=now)
    return with_event(changed, now, dst.value, message)


def admit(job: Job, placement: tuple[NodeAssignment, ...], now: float) -> Job:
    nodes = ", ".join(a.node_id for a in placement)
    admitted = transition(job, JobState.ADMITTED, now, f"placed on {nodes}")
    return replace(admitted, placement=placement)


def request_cancel(job: Job, now: float, reason: str) -> Job:
    """Pending jobs are cancelled at once; placed ones are marked and stopped by the leader.
    Idempotent: cancelling a cancelled (or otherwise finished) job returns it unchanged."""
    if job.state.terminal or job.cancel_requested:
        return job
    why = reason or "cancelled by user"
    if job.state is JobState.PENDING:
        return transition(job, JobState.CANCELLED, now, why)
    return with_event(replace(job, cancel_requested=True), now, "cancel_requested", why)


def first_failure(exits: tuple[WorkerExit, ...]) -> WorkerExit | None:
    failed = [e for e in exits if not e.ok]
    return min(failed, key=lambda e: (e.at, e.rank)) if failed else None


def describe_exit(e: WorkerExit) -> str:
    if e.signal:
        return f"rank {e.rank} on {e.node_id} was killed by signal {e.signal}"
    return f"rank {e.rank} on {e.node_id} exited with code {e.exit_code}"
