"""The write side of a cycle's placement: each decision committed as its gang's one transaction, each
preemption's victims marked for stopping.

`place` (policy/place.py) decides over a snapshot; this module turns its decisions into records, CAS-guarded on
the snapshot's revisions, so a decision taken on a view that has since changed is refused by the store and
taken again next cycle. Separate from the reconciler's loop (reconcile.py), which decides when to cycle and
what else a cycle does (progress, requeues, usage).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from trainyard_core import telemetry
from trainyard_core.logs import log_context

from . import metrics
from .cycle_writes import CycleWrites
from .domain.jobs import admit, transition, with_event
from .domain.models import Allocation, JobState
from .domain.queues import PolicyConfig, standing
from .domain.snapshot import ClusterSnapshot
from .policy.place import Decision, Preemption
from .state.repository import Repository

log = logging.getLogger(__name__)
# A job's decision and commit are spans of the trace its submit began (Job.trace_parent).
_tracer = telemetry.tracer("trainyard_scheduler.reconcile")


class PlacementWrites:
    def __init__(self, repo: Repository, events: metrics.Events, writes: CycleWrites) -> None:
        self._repo = repo
        self._events = events
        self._writes = writes

    async def commit(self, snap: ClusterSnapshot, config: PolicyConfig, d: Decision, now: float,
                      decided: tuple[int, int]) -> None:
        """Commit one decision of the cycle's placement; `decided`: when the placement ran (ns), a span of the
        job's trace as the commit is."""
        job = snap.jobs[d.job_id]
        master = snap.nodes[d.assignments[0].node_id]
        spec = job.spec
        alloc = Allocation(job_id=job.id, attempt=job.attempt, assignments=d.assignments,
                           master_addr=master.worker_address, master_port=d.master_port, created_at=now,
                           team=job.team, priority=standing(spec.queue, spec.priority_class, spec.priority, config),
                           borrowed=d.borrowed, preemptible=config.priority_class(spec.priority_class).preemptible,
                           expected_end=now + spec.time_limit_s if spec.time_limit_s > 0 else None)
        attributes: telemetry.SpanAttributes = {telemetry.JOB_ID: job.id, telemetry.ATTEMPT: job.attempt,
                                                telemetry.NODE_IDS: list(alloc.node_ids)}
        telemetry.record_span(_tracer, "reconcile.decide", job.trace_parent, *decided,
                              {**attributes, "trainyard.model": d.model, "trainyard.borrowed": d.borrowed,
                               "trainyard.tier": d.tier})
        with log_context(job_id=job.id), telemetry.continued(_tracer, "reconcile.commit", job.trace_parent,
                                                             attributes):
            if await self._writes.attempt(self._repo.commit_placement(admit(job, d.assignments, now),
                                                           snap.job_revisions[job.id], alloc)):
                metrics.GANGS_PLACED.inc()
                self._events.placed(job, now)
                log.info("gang placed", extra={"nodes": list(alloc.node_ids), "world_size": alloc.world_size,
                                               "model": d.model, "borrowed": d.borrowed, "tier": d.tier})

    async def preempt(self, snap: ClusterSnapshot, config: PolicyConfig, p: Preemption, now: float) -> None:
        """Each victim in one transaction: its job becomes PREEMPTED and its allocation gets the stop reason
        and the preemptor; progress() then stops it with the job's own signal and grace."""
        stopping: list[str] = []
        preemptor = snap.jobs.get(p.preemptor)
        mine = (standing(preemptor.spec.queue, preemptor.spec.priority_class, preemptor.spec.priority, config)
                if preemptor is not None else None)
        for victim_id in p.victims:
            job = snap.jobs.get(victim_id)
            alloc = snap.allocations.get(victim_id)
            if job is None or alloc is None or alloc.stop_reason:
                continue
            marked = replace(alloc, stop_reason=p.reason, preempted_by=p.preemptor,
                             stop_signal=job.spec.preemption.signal, stop_grace_s=job.spec.preemption.grace_s)
            new_job = job if job.state is JobState.PREEMPTED else transition(job, JobState.PREEMPTED, now, p.reason)
            with log_context(job_id=victim_id, trace_id=telemetry.trace_id_of(job.trace_parent)):
                if await self._writes.attempt(self._repo.write(
                        job=new_job, job_rev=snap.job_revisions[victim_id], alloc=marked,
                        alloc_rev=snap.allocation_revisions[victim_id])):
                    # As placement chose it: outranked, or on borrowed GPUs its owner's team reclaims.
                    self._events.preempted("priority" if mine is not None and mine > alloc.priority else "reclaim",
                                           alloc.team or job.team)
                    stopping.append(victim_id)
                    log.info("gang preempted", extra={"preemptor": p.preemptor})
        if stopping and preemptor is not None:
            note = with_event(replace(preemptor, message=f"preempting {', '.join(stopping)}"), now, "preempting",
                              f"stopping {len(stopping)} gang(s) to make room: {', '.join(stopping)}")
            await self._writes.attempt(self._repo.write(job=note, job_rev=snap.job_revisions[p.preemptor]))
