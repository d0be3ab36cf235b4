"""A consistent view of the cluster that decisions are computed over."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .models import Allocation, Job, Node


@dataclass(frozen=True)
class ClusterSnapshot:
    nodes: Mapping[str, Node]
    # Nodes whose agent is connected and heartbeating now.
    alive: frozenset[str]
    jobs: Mapping[str, Job]
    allocations: Mapping[str, Allocation]
    # Store revision each record was read at (for compare-and-swap when committing).
    job_revisions: Mapping[str, int] = field(default_factory=dict)
    allocation_revisions: Mapping[str, int] = field(default_factory=dict)
    # What each node's agent last reported running: {(job_id, attempt)}.
    reported_running: Mapping[str, frozenset[tuple[str, int]]] = field(default_factory=dict)
    # When each node's report arrived, and when this leader released each gang (monotonic seconds).
    reported_at: Mapping[str, float] = field(default_factory=dict)
    released_at: Mapping[tuple[str, int], float] = field(default_factory=dict)
    # For nodes not alive: seconds this leader has not heard from them (since it leads, for nodes it never
    # heard). A lost node's workers are presumed dead once this passes the worker fence.
    silence: Mapping[str, float] = field(default_factory=dict)

    def orphans(self) -> dict[str, set[tuple[str, int]]]:
        """Workers an agent runs that no allocation accounts for on that node (e.g. a node that was
        declared lost, whose gang was released, and that came back). Their GPUs are not free: the node
        takes no new gang until they are stopped.

        A report that arrived before this leader released the gang is stale, not an orphan: the gang
        ended normally after the agent's last heartbeat, which blocking the node for would only delay
        the next placement by up to a heartbeat interval."""
        out: dict[str, set[tuple[str, int]]] = {}
        for node_id, running in self.reported_running.items():
            for job_id, attempt in running:
                alloc = self.allocations.get(job_id)
                if alloc is not None and alloc.attempt == attempt and node_id in alloc.node_ids:
                    continue
                released = self.released_at.get((job_id, attempt))
                if released is not None and self.reported_at.get(node_id, float("inf")) <= released:
                    continue
                out.setdefault(node_id, set()).add((job_id, attempt))
        return out

    def used_gpus(self) -> dict[str, set[int]]:
        used: dict[str, set[int]] = {}
        for alloc in self.allocations.values():
            for a in alloc.assignments:
                used.setdefault(a.node_id, set()).update(a.gpu_indices)
        return used

    def used_master_ports(self) -> dict[str, set[int]]:
        ports: dict[str, set[int]] = {}
        for alloc in self.allocations.values():
            if alloc.assignments:
                ports.setdefault(alloc.assignments[0].node_id, set()).add(alloc.master_port)
        return ports

    def gpus_held(self) -> dict[str, dict[str, int]]:
        """GPUs each team's gangs hold now, by accelerator model ("unknown" for a share without one):
        `team → model → count`, what fair-share usage accrues from."""
        holding: dict[str, dict[str, int]] = {}
        for alloc in self.allocations.values():
            team = alloc.team or (self.jobs[alloc.job_id].team if alloc.job_id in self.jobs else "")
            for a in alloc.assignments:
                if a.gpu_indices:
                    row = holding.setdefault(team, {})
                    row[a.model or "unknown"] = row.get(a.model or "unknown", 0) + len(a.gpu_indices)
        return holding
