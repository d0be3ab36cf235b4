"""Pure: what should happen next to one placed gang, given its job, allocation and which nodes live.

A gang is stopped as a whole as soon as one reason appears (cancel, a failed rank, a lost node, a
refused launch); its allocation — and so its GPUs — is released only once every node has confirmed the
stop or reported every rank's exit (a lost node cannot: its workers are presumed dead, and if the node
comes back the agent is told to stop whatever it still runs), so no GPU is handed out while a worker may
still run on it.

Infrastructure failures restart the job without using its restart budget (`max_restarts`): a node lost,
a GPU of the gang unhealthy, a rank ended by its node's agent shutting down with its workers — also when
the first thing the scheduler heard was a rank failing (the surviving ranks of a gang crash as soon as a
peer's node dies, usually before the node's heartbeat deadline). The failure is attributed when the gang
is released: if by then one of its nodes is lost or one of its GPUs unhealthy, it was the infrastructure.
They are bounded separately (`infra_restart_limit`), so a job that keeps killing nodes still ends.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from .jobs import describe_exit, end_attempt, first_failure, requeue, restart_delay, transition
from .models import EXIT_UNKNOWN, Allocation, Job, JobState, Node, WorkerExit
from .operations import requeue_reason


@dataclass(frozen=True)
class Step:
    job: Job | None = None          # new job record to write, None when unchanged
    alloc: Allocation | None = None  # new allocation record to write, None when unchanged
    release: bool = False            # delete the allocation (the job is written terminal with it)
    launch: tuple[str, ...] = ()     # nodes whose agent must start its workers
    stop: tuple[str, ...] = ()       # nodes whose agent must stop its workers
    recheck_in: float | None = None  # seconds until this gang needs looking at again (a worker fence)
    notes: list[str] = field(default_factory=list)

    @property
    def writes(self) -> bool:
        return self.job is not None or self.alloc is not None or self.release


def progress(job: Job, alloc: Allocation, alive: frozenset[str], now: float,
             nodes: Mapping[str, Node] | None = None, *, infra_restart_limit: int = 20,
             silence: Mapping[str, float] | None = None, fence_s: float = 0.0) -> Step:
    """`silence` (seconds each lost node has been silent) and `fence_s` (the worker fence plus a margin):
    a lost node's workers count as gone only once it has been silent that long — by then its shims have
    killed them if they were still running — so a gang is not released, and its job not started again,
    while an old attempt may still run there."""
    exited = {e.rank for e in alloc.exits}
    reason = alloc.stop_reason
    new_alloc: Allocation | None = None
    if not reason:
        failure = first_failure(alloc.exits)
        # A rank its agent ended as the agent shut down (even one that exited 0 on the signal) did not finish:
        # the host went away under the job.
        shutdown = next((e for e in alloc.exits if e.agent_shutdown), None)
        lost = [n for n in alloc.node_ids if n not in alive]
        sick = _unhealthy_gpu(alloc, nodes or {})
        infra = requeued = False
        if job.cancel_requested:
            reason = "cancelled"
        elif failure is not None and not failure.agent_shutdown:
            reason = describe_exit(failure)
        elif shutdown is not None:
            reason, infra = describe_exit(shutdown), True
        elif job.requeue_requested_by:
            reason, requeued = requeue_reason(job), True
        elif alloc.expected_end is not None and now >= alloc.expected_end and job.spec.time_limit_s > 0:
            reason = f"time limit of {job.spec.time_limit_s:g}s exceeded"
        elif lost:
            reason, infra = f"node {lost[0]} lost contact", True
        elif sick:
            reason, infra = sick, True
        if reason:
            new_alloc = replace(alloc, stop_reason=reason, infra_failure=infra)
        if requeued:
            # Stopped like a preemption: the job's own signal first (it may checkpoint), then its grace.
            new_alloc = replace(alloc, stop_reason=reason, requeued_by=job.requeue_requested_by,
                                stop_signal=job.spec.preemption.signal, stop_grace_s=job.spec.preemption.grace_s)

    if reason:
        current = new_alloc or alloc
        to_stop = tuple(a.node_id for a in current.assignments
                        if a.node_id not in current.stopped and a.node_id in alive
                        and not set(a.ranks) <= exited)
        if to_stop:
            return Step(alloc=new_alloc, stop=to_stop)
        silent = silence or {}
        unfenced = [fence_s - silent.get(a.node_id, math.inf) for a in current.assignments
                    if a.node_id not in alive and a.node_id not in current.stopped and not set(a.ranks) <= exited]
        if any(left > 0 for left in unfenced):
            return Step(alloc=new_alloc, recheck_in=max(unfenced))
        return Step(job=_finish(job, current, now, infra=_infra_cause(current, alive, nodes or {}),
                                infra_restart_limit=infra_restart_limit), release=True)

    if len(exited) == alloc.world_size:  # every rank exited, none failed
        return Step(job=_finish(job, alloc, now), release=True)

    to_launch = tuple(n for n in alloc.node_ids if n not in alloc.launched)
    if to_launch:
        return Step(launch=to_launch)
    if job.state is JobState.ADMITTED:
        return Step(job=transition(job, JobState.RUNNING, now,
                                   f"{alloc.world_size} worker(s) running on {len(alloc.assignments)} node(s)"))
    return Step()


def _unhealthy_gpu(alloc: Allocation, nodes: Mapping[str, Node]) -> str:
    """The first GPU of the gang that its node reports unhealthy, as a reason; "" when none."""
    for a in alloc.assignments:
        node = nodes.get(a.node_id)
        if node is None:
            continue
        for gpu in node.gpus:
            if gpu.index in a.gpu_indices and not gpu.healthy:
                return f"GPU {gpu.index} on {a.node_id} became unhealthy: {gpu.health_reason or 'no reason given'}"
    return ""


def _infra_cause(alloc: Allocation, alive: frozenset[str], nodes: Mapping[str, Node]) -> str:
    """Why a stopped gang's failure is the infrastructure's ("" when it is not): it was stopped for a lost
    node or an unhealthy GPU, or it was stopped for a failed rank and by now one of its nodes is lost or
    one of its GPUs unhealthy, or the failed rank's end is unknown (the agent found no status: its shim
    died). A time limit is never an infrastructure failure."""
    if alloc.infra_failure:
        return alloc.stop_reason
    failure = stopping_failure(alloc)
    if failure is None:
        return ""
    lost = [n for n in alloc.node_ids if n not in alive]
    cause = f"node {lost[0]} lost contact" if lost else _unhealthy_gpu(alloc, nodes)
    if not cause and failure.exit_code == EXIT_UNKNOWN and not failure.signal:
        # The agent found no exit status: the worker's shim died with it (the node's own machinery failed,
        # e.g. everything on the host was killed), not something the job's code did.
        cause = f"the end of rank {failure.rank} on {failure.node_id} is unknown (its supervisor died)"
    return f"{cause} ({alloc.stop_reason})" if cause else ""


def stopping_failure(alloc: Allocation) -> WorkerExit | None:
    """The failed rank the gang was stopped for (None: stopped for something else, or not stopped).
    Not simply the earliest failure: ranks that fail together are reported in any order, and one whose
    report arrives after the stop may carry an earlier exit time than the one the stop names."""
    return next((e for e in alloc.exits if not e.ok and describe_exit(e) == alloc.stop_reason), None)


def _finish(job: Job, alloc: Allocation, now: float, *, infra: str = "", infra_restart_limit: int = 20) -> Job:
    """The job as the release of `alloc` leaves it: its next state, and the attempt's record. A requeue asked
    while the gang was being stopped for something else is dropped with it (it would stop the next attempt)."""
    after = _after(job, alloc, now, infra=infra, infra_restart_limit=infra_restart_limit)
    return end_attempt(replace(after, requeue_requested_by=""), alloc, now)


def _after(job: Job, alloc: Allocation, now: float, *, infra: str, infra_restart_limit: int) -> Job:
    exits = tuple(sorted(alloc.exits, key=lambda e: e.rank))
    failure = stopping_failure(alloc) or first_failure(alloc.exits)
    if job.cancel_requested:
        done = transition(job, JobState.CANCELLED, now, "cancelled; workers stopped")
    elif alloc.preempted_by:
        stopped = job if job.state is JobState.PREEMPTED else transition(job, JobState.PREEMPTED, now,
                                                                            alloc.stop_reason)
        requeued = requeue(stopped, now, f"requeued after preemption by {alloc.preempted_by}")
        return replace(requeued, preempted_by=(*job.preempted_by, alloc.preempted_by)[-20:])
    elif alloc.requeued_by:
        return requeue(job, now, f"requeued by {alloc.requeued_by}: attempt {job.attempt + 1} queued (a requeue "
                                 "counts against no restart budget)")
    elif infra and job.infra_restarts < infra_restart_limit:
        counted = replace(job, infra_restarts=job.infra_restarts + 1, exits=exits)
        restarting = transition(counted, JobState.RESTARTING, now,
                                f"{infra}; infrastructure failure {counted.infra_restarts} (not counted against "
                                f"max_restarts): restarting on healthy nodes")
        return replace(restarting, not_before=now)
    elif infra:
        done = transition(job, JobState.FAILED, now, f"{infra} (infrastructure restart limit of "
                                                     f"{infra_restart_limit} reached)")
    elif stopping_failure(alloc) is not None and job.restarts < job.spec.max_restarts:
        counted = replace(job, restarts=job.restarts + 1, exits=exits)
        delay = restart_delay(counted)
        restarting = transition(counted, JobState.RESTARTING, now,
                                f"{alloc.stop_reason}; restart {counted.restarts} of {job.spec.max_restarts} "
                                f"in {delay:g}s")
        return replace(restarting, not_before=now + delay)
    elif alloc.stop_reason or failure is not None:
        why = alloc.stop_reason or (describe_exit(failure) if failure else "failed")
        if failure is not None and job.spec.max_restarts and job.restarts >= job.spec.max_restarts:
            why += f" (restart budget of {job.spec.max_restarts} used up)"
        done = transition(job, JobState.FAILED, now, why)
        code = failure.exit_code if failure is not None and failure.exit_code else (
            128 + failure.signal if failure is not None and failure.signal else 0)
        done = replace(done, exit_code=code)
    else:
        done = transition(job, JobState.SUCCEEDED, now, f"all {alloc.world_size} worker(s) exited 0")
    return replace(done, exits=exits)
