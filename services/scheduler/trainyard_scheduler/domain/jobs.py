"""Job lifecycle.

States and transitions (who writes them; every write is one etcd transaction guarded by the job's mod
revision and, for the scheduler's own writes, by the leader's epoch):

    PENDING   --place (leader: job + allocation in one txn)-->               ADMITTED
    ADMITTED  --every node's agent confirmed the launch (leader)-->          RUNNING
    RUNNING   --every rank exited 0 (leader, allocation deleted)-->          SUCCEEDED
    ADMITTED/RUNNING --a rank failed / launch refused / node lost: workers stopped,
                       then allocation deleted (leader)-->                   FAILED
    ADMITTED/RUNNING --time limit reached: workers stopped (leader)-->        FAILED
    ADMITTED/RUNNING --a rank failed and restarts are left, or a node was lost / a GPU went
                       unhealthy: workers stopped, allocation deleted (leader)--> RESTARTING
    RESTARTING --backoff elapsed (leader; attempt + 1)-->                     PENDING
    ADMITTED/RUNNING --chosen as a preemption victim (leader: job + allocation's stop
                       reason in one txn)-->                                 PREEMPTED
    PREEMPTED --workers stopped, allocation deleted (leader; attempt + 1,
                the preemptor remembered so it is never preempted back)-->  PENDING
    ADMITTED/RUNNING --requeue asked (any replica sets requeue_requested_by); the leader stops the
                       workers with the job's preemption signal and grace, deletes the allocation
                       (attempt + 1, counted in no restart budget)-->       PENDING
    PENDING/RESTARTING --cancel (any replica, CAS on the job)-->             CANCELLED
    ADMITTED/RUNNING/PREEMPTED --cancel sets cancel_requested (any replica); the leader
                       stops the workers, deletes the allocation-->          CANCELLED

A PENDING job may be held (`held_by`, any replica): it stays PENDING, in its place in the queue (queued_at
unchanged), but placement skips it until it is released. Hold, release, priority change and requeue are in
operations.py.

SUCCEEDED, FAILED and CANCELLED are terminal: nothing leaves them. An allocation exists exactly while a
job is ADMITTED, RUNNING or PREEMPTED, or is being stopped on its way to a terminal state or to
RESTARTING. A RESTARTING job has no allocation. Restarts after a failed rank count against
`spec.max_restarts` (`job.restarts`); restarts after infrastructure failures (a lost node, an unhealthy
GPU; see progress.py) count in `job.infra_restarts` against the scheduler's `max_infra_restarts`, and
start at once; requeues after preemption count in neither.
"""

from __future__ import annotations

from dataclasses import replace

from trainyard_core.errors import FailedPrecondition

from .models import Allocation, AttemptRecord, Job, JobEvent, JobState, NodeAssignment, WorkerExit

_ALLOWED: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.ADMITTED, JobState.CANCELLED, JobState.FAILED}),
    JobState.ADMITTED: frozenset({JobState.RUNNING, JobState.FAILED, JobState.CANCELLED,
                                  JobState.SUCCEEDED, JobState.PREEMPTED, JobState.RESTARTING, JobState.PENDING}),
    JobState.RUNNING: frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED,
                                 JobState.PREEMPTED, JobState.RESTARTING, JobState.PENDING}),
    JobState.PREEMPTED: frozenset({JobState.PENDING, JobState.CANCELLED, JobState.FAILED}),
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


def request_cancel(job: Job, now: float, reason: str, by: str = "") -> Job:
    """Pending jobs are cancelled at once; placed ones are marked and stopped by the leader. `by` (who
    asked) is recorded as `cancelled_by` and named in the event. Idempotent: cancelling a cancelled (or
    otherwise finished) job returns it unchanged, so the first canceller stays recorded."""
    if job.state.terminal or job.cancel_requested:
        return job
    why = reason or (f"cancelled by {by}" if by else "cancelled by user")
    job = replace(job, cancelled_by=by)
    if job.state in (JobState.PENDING, JobState.RESTARTING):
        return transition(job, JobState.CANCELLED, now, why)
    return with_event(replace(job, cancel_requested=True), now, "cancel_requested", why)


# Attempts a job record keeps (a job preempted over and over has no bound of its own); the history store
# and usage accounting see the same ones.
MAX_ATTEMPTS_KEPT = 200


def end_attempt(job: Job, alloc: Allocation, now: float) -> Job:
    """`job` (already in the state the attempt's end led to) with the record of `alloc`'s attempt appended;
    idempotent: an attempt recorded already is not recorded twice."""
    if any(a.attempt == alloc.attempt for a in job.attempts):
        return job
    models = sorted({a.model for a in alloc.assignments if a.model})
    record = AttemptRecord(attempt=alloc.attempt, started_at=alloc.created_at, ended_at=now,
                           nodes=alloc.node_ids, gpus=alloc.gpus, cpus=sum(a.cpus for a in alloc.assignments),
                           model="+".join(models), reason=alloc.stop_reason,
                           # A preempted gang's job is PENDING again by now: its attempt ended preempted.
                           outcome=JobState.PREEMPTED.value if alloc.preempted_by else job.state.value)
    return replace(job, attempts=(*job.attempts, record)[-MAX_ATTEMPTS_KEPT:])


MAX_BACKOFF_S = 600.0


def restart_delay(job: Job) -> float:
    """Exponential backoff: the base delay for the first restart, doubling after each, capped."""
    return float(min(MAX_BACKOFF_S, job.spec.restart_backoff_s * 2.0 ** max(0, job.restarts - 1)))


def requeue(job: Job, now: float, message: str) -> Job:
    """Back to PENDING as a new attempt (after preemption, a restart's backoff, or a requeue someone asked for)."""
    pending = transition(job, JobState.PENDING, now, message)
    return replace(pending, attempt=job.attempt + 1, placement=(), exits=(), queued_at=now, not_before=0.0,
                   started_at=None, requeue_requested_by="")


def due_for_requeue(job: Job, now: float) -> Job | None:
    """A RESTARTING job whose backoff has elapsed, as its next PENDING attempt; None while it waits."""
    if job.state is not JobState.RESTARTING or job.cancel_requested or now < job.not_before:
        return None
    return requeue(job, now, f"attempt {job.attempt + 1} queued (restarts: {job.restarts} of {job.spec.max_restarts} "
                             f"after failures, {job.infra_restarts} after infrastructure failures)")


def first_failure(exits: tuple[WorkerExit, ...]) -> WorkerExit | None:
    failed = [e for e in exits if not e.ok]
    return min(failed, key=lambda e: (e.at, e.rank)) if failed else None


def describe_exit(e: WorkerExit) -> str:
    if e.agent_shutdown:
        return f"rank {e.rank} on {e.node_id} was stopped by its node's agent shutting down"
    if e.signal:
        return f"rank {e.rank} on {e.node_id} was killed by signal {e.signal}"
    return f"rank {e.rank} on {e.node_id} exited with code {e.exit_code}"
