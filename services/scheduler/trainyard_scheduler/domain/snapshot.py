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
