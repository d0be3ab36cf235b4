"""Preemption cost: borrowed gangs first, then lowest standing, then the job preempted least often so far
(the pain is spread), then least work lost since the last checkpoint (GPU-seconds), then the youngest."""

from __future__ import annotations

from ...domain.models import Allocation, Job


def lost_gpu_seconds(job: Job, alloc: Allocation, now: float) -> float:
    since = max(x for x in (job.started_at, job.last_checkpoint_at, alloc.created_at) if x is not None)
    return max(0.0, now - since) * alloc.gpus


class LeastLostWork:
    name = "least-lost-work"

    def cost(self, job: Job, alloc: Allocation, now: float) -> tuple[float, ...]:
        return (0 if alloc.borrowed else 1, *alloc.priority, len(job.preempted_by), lost_gpu_seconds(job, alloc, now),
                -alloc.created_at)
