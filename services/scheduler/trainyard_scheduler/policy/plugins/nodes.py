"""Node-level plugins: which nodes may take work, which a job accepts, and in what order."""

from __future__ import annotations

from ...domain.models import Job
from ...domain.queues import PolicyConfig
from ..api import NodeView


class NodeReady:
    """Gate: the agent heartbeats, the node is not cordoned, and no stray workers hold its GPUs."""

    name = "node-ready"

    def admit(self, view: NodeView) -> str | None:
        if not view.alive:
            return "node not ready"
        if view.node.cordoned:
            return "node cordoned"
        if view.has_orphans:
            return "node still runs workers of a released gang"
        return None


class QueuePartition:
    """A queue with `node_labels` runs only on nodes that carry all of them (like a Slurm partition)."""

    name = "queue-partition"

    def applies(self, job: Job, config: PolicyConfig) -> bool:
        return bool(config.queue(job.spec.queue).node_labels)

    def filter(self, job: Job, view: NodeView, config: PolicyConfig) -> str | None:
        want = config.queue(job.spec.queue).node_labels
        labels = view.node.labels
        if any(labels.get(k) != v for k, v in want.items()):
            return f"not in queue {job.spec.queue}'s partition"
        return None


class CpuFit:
    """The node has the CPUs a share asks for (a CPU task needs at least one)."""

    name = "cpu-fit"

    def applies(self, job: Job, config: PolicyConfig) -> bool:
        return job.spec.resources.cpus_per_node > 0 or job.spec.resources.cpu_only

    def filter(self, job: Job, view: NodeView, config: PolicyConfig) -> str | None:
        r = job.spec.resources
        need = r.cpus_per_node or (1 if r.cpu_only else 0)
        if need and view.free_cpus < need:
            return f"{view.free_cpus} of {need} CPUs free"
        return None


class BestFit:
    """Fewest free GPUs first: fill partly used nodes, keep whole nodes whole for whole-node shares."""

    name = "best-fit"

    def score(self, job: Job, view: NodeView) -> float:
        return float(len(view.free_gpus))
