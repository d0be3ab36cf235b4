"""Filters: the node is reachable, schedulable, has the asked accelerator and enough free healthy GPUs."""

from __future__ import annotations

from ...domain.models import Job
from ..api import NodeView


def matching_free(job: Job, view: NodeView) -> tuple[int, ...]:
    """Free GPUs of the node that satisfy the job's accelerator request."""
    want = job.spec.resources.accelerator
    if not want:
        return view.free_gpus
    by_index = {g.index: g for g in view.node.gpus}
    return tuple(i for i in view.free_gpus if by_index[i].model == want)


class NodeReady:
    name = "node-ready"

    def filter(self, job: Job, view: NodeView) -> str | None:
        if not view.alive:
            return "node not ready"
        if view.node.cordoned:
            return "node cordoned"
        if view.has_orphans:
            return "node still runs workers of a released gang"
        return None


class AcceleratorFit:
    name = "accelerator-fit"

    def filter(self, job: Job, view: NodeView) -> str | None:
        want = job.spec.resources.accelerator
        if want and not any(g.model == want for g in view.node.gpus):
            return f"no {want}"
        return None


class GpuCountFit:
    name = "gpu-count-fit"

    def filter(self, job: Job, view: NodeView) -> str | None:
        need = job.spec.resources.gpus_per_node
        have = len(matching_free(job, view))
        if have < need:
            return f"{have} of {need} GPUs free"
        return None
