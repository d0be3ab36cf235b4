"""Gangs placed node by node: CPU-only jobs, and jobs allowed to mix accelerator models.

Every other gang is one block of one model, found by the pool's search (capacity.py). These two instead
take each node on its own merit (its free CPUs; the fastest admitted model it has room for) and choose
nodes leaf by leaf (`select_by_leaves`), so they share neither the search nor its pool; the session
commits what they return like any other decision.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..domain.models import Job, NodeAssignment
from .capacity import select_by_leaves
from .results import Decision
from .topology import gang_tier, pick_gpus

if TYPE_CHECKING:
    from .place import _Session


def place_cpu(s: _Session, job: Job) -> tuple[Decision | None, str]:
    """Where a CPU-only gang goes now, or why it waits; takes nothing (the session commits)."""
    r = job.spec.resources
    ok = s.node_ok(job)
    per_leaf: dict[str, list[str]] = {}
    for node_id in s.cpu_nodes:
        if ok(node_id):
            per_leaf.setdefault(s.paths[node_id][0], []).append(node_id)
    chosen = select_by_leaves(list(per_leaf.values()), r.nodes, lambda n: float(s.free_cpus[n]))
    if chosen is None:
        return None, (f"waiting for {r.nodes} CPU-only node(s) with {r.cpus_per_node or 1} free CPU(s); "
                      f"{sum(len(v) for v in per_leaf.values())} have room")
    ordered = sorted(chosen, key=lambda n: (s.paths[n][2], s.paths[n][1], s.paths[n][0], n))
    assignments = tuple(NodeAssignment(node_id=n, node_rank=i, gpu_indices=(), ranks=(i,), model="",
                                       cpus=r.cpus_per_node or 1) for i, n in enumerate(ordered))
    return s.with_port(job, Decision(job.id, assignments, 0, "", False, gang_tier(ordered, s.paths))), ""


def place_mixed(s: _Session, job: Job, admitted: Sequence[tuple[str, bool]]) -> Decision | None:
    """A gang allowed to mix models: each node's share is of one model (the fastest the node has)."""
    r = job.spec.resources
    ok = s.node_ok(job)
    best_model: dict[str, str] = {}
    for model, _ in admitted:  # fastest first
        pool = s.pools.get(model)
        if pool is None:
            continue
        for node_id, free in pool.free.items():
            if node_id not in best_model and len(free) >= r.gpus_per_node and ok(node_id):
                best_model[node_id] = model
    per_leaf: dict[str, list[str]] = {}
    for node_id in best_model:
        per_leaf.setdefault(s.paths[node_id][0], []).append(node_id)
    chosen = select_by_leaves(list(per_leaf.values()), r.nodes, lambda n: float(len(s.pools[best_model[n]]
                                                                                   .free[n])))
    if chosen is None:
        return None
    tier = gang_tier(chosen, s.paths)
    if tier > s.max_tier(job):
        return None
    ordered = sorted(chosen, key=lambda n: (s.paths[n][2], s.paths[n][1], s.paths[n][0], n))
    assignments = []
    for node_rank, node_id in enumerate(ordered):
        model = best_model[node_id]
        gpus = pick_gpus(s.pools[model].free[node_id], r.gpus_per_node, s.gpu_islands(node_id))
        first = node_rank * r.gpus_per_node
        assignments.append(NodeAssignment(node_id, node_rank, gpus, tuple(range(first, first + r.gpus_per_node)),
                                          model=model, cpus=r.cpus_per_node))
    borrowed = any(b for _, b in admitted)
    models = sorted({a.model for a in assignments})
    return s.with_port(job, Decision(job.id, tuple(assignments), 0, models[0] if len(models) == 1 else
                                     "mixed", borrowed, tier))
