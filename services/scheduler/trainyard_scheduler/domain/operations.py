"""What users do to their jobs beside submit and cancel (Slurm's `scontrol hold/release/update/requeue`): pure
functions from a job to the job as the operation leaves it, or a domain error. Any replica applies them
(servicer: read the job, apply, CAS-write it); the leader's reconcile loop carries out what needs the
cluster (placement skips held jobs; a requeue is a stop of the gang, in progress.py).

- **hold** (PENDING only): `held_by` and `hold_reason` set, state unchanged, so the job keeps its place in
  the queue (`queued_at` is not touched) and placement passes over it. Holding a held job changes nothing
  (the first holder stays recorded).
- **release**: the hold is lifted; the job is PENDING as before, in its original place. Releasing a pending
  job that is not held changes nothing. Who may lift whose hold is the gateway's (roles.check_release).
- **set_priority** (any job not finished): `spec.priority` is replaced; placement reads it at the next
  cycle, and the leader copies it into a placed gang's standing (`restand`), so a preemption decision may
  follow either way. The same priority changes nothing.
- **request_requeue** (ADMITTED/RUNNING): `requeue_requested_by` set; the leader stops the gang with the
  job's preemption signal and grace and, once it is released, puts the job back to PENDING as a new
  attempt, counted in neither restart budget. Asking again, or for a job already PREEMPTED (on its way
  back to the queue), changes nothing.

Every change appends an event naming who did it. Refusals are FailedPrecondition (wrong state) or
InvalidArgument (a priority out of range); idempotent repeats return the job object itself (`is` the input),
so the caller writes nothing.
"""

from __future__ import annotations

from dataclasses import replace

from trainyard_core import contract
from trainyard_core.errors import FailedPrecondition, InvalidArgument

from .jobs import with_event
from .models import Allocation, Job, JobState

# What a pending job says until the leader writes why it waits (a new job, a released one).
WAITING_MESSAGE = "waiting for placement"


def _who(by: str) -> str:
    return by or "unknown"


def hold(job: Job, now: float, by: str, reason: str = "") -> Job:
    if job.state is JobState.PENDING and job.held_by:
        return job
    if job.state is not JobState.PENDING or job.cancel_requested:
        raise FailedPrecondition(f"job {job.id} is {job.state.value}: only a pending job can be held (a placed one "
                                 "can be requeued, then held)")
    why = f"held by {_who(by)}" + (f": {reason}" if reason else "")
    held = replace(job, held_by=_who(by), hold_reason=reason, message=f"{why}; not placed until released")
    return with_event(held, now, "held", why)


def release(job: Job, now: float, by: str) -> Job:
    if job.state is not JobState.PENDING:
        raise FailedPrecondition(f"job {job.id} is {job.state.value}: only a pending job can be held or released")
    if not job.held_by:
        return job
    released = replace(job, held_by="", hold_reason="", message=WAITING_MESSAGE)
    return with_event(released, now, "released", f"released by {_who(by)} (held by {job.held_by}); back in its "
                                                 "place in the queue")


def set_priority(job: Job, now: float, by: str, priority: int) -> Job:
    if not contract.MIN_PRIORITY <= priority <= contract.MAX_PRIORITY:
        raise InvalidArgument(f"priority must be between {contract.MIN_PRIORITY} and {contract.MAX_PRIORITY}, "
                              f"got {priority}")
    if job.state.terminal:
        raise FailedPrecondition(f"job {job.id} is {job.state.value}: a finished job's priority cannot change "
                                 "(resubmit it with another priority)")
    if job.spec.priority == priority:
        return job
    changed = replace(job, spec=replace(job.spec, priority=priority))
    return with_event(changed, now, "priority_changed",
                      f"priority {job.spec.priority} -> {priority} by {_who(by)}")


def request_requeue(job: Job, now: float, by: str, reason: str = "") -> Job:
    if job.requeue_requested_by or job.state is JobState.PREEMPTED:
        return job
    if job.cancel_requested:
        raise FailedPrecondition(f"job {job.id} is being cancelled: it cannot be requeued")
    if job.state not in (JobState.ADMITTED, JobState.RUNNING):
        raise FailedPrecondition(f"job {job.id} is {job.state.value}: only an admitted or running job can be "
                                 "requeued")
    why = f"requeue requested by {_who(by)}" + (f": {reason}" if reason else "")
    return with_event(replace(job, requeue_requested_by=_who(by)), now, "requeue_requested", why)


def requeue_reason(job: Job) -> str:
    """The stop reason of a gang stopped for its job's requeue."""
    return f"requeued by {job.requeue_requested_by}"


def restand(job: Job, alloc: Allocation) -> Allocation | None:
    """A placed gang's standing after its job's priority changed (None: unchanged). The queue tier and class
    value were fixed at placement and do not change; only the priority does."""
    tier, value, priority = alloc.priority
    if priority == job.spec.priority:
        return None
    return replace(alloc, priority=(tier, value, job.spec.priority))
