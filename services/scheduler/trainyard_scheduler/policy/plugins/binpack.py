"""Best-fit scoring: prefer the node the job fills most, so large free blocks stay whole for big jobs."""

from __future__ import annotations

from ...domain.models import Job
from ..api import NodeView
from .fit import matching_free


class BestFit:
    name = "best-fit"

    def score(self, job: Job, view: NodeView) -> float:
        free = len(matching_free(job, view))
        if free == 0:
            return 0.0
        # 1.0 when the job takes every free GPU; smaller the more would be left over.
        return job.spec.resources.gpus_per_node / free
