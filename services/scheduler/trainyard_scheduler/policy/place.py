"""The pure placement entry point: `place(snapshot, profile, now) -> list[Decision]`.

Each pending job is placed whole or not at all: its `nodes` shares are chosen on distinct nodes in one
decision, and GPUs taken by earlier decisions of the same call are not offered again. Jobs are taken in
priority order, then submission order. A job that does not fit now is skipped so smaller jobs behind it
can use the free GPUs (reservations for big jobs arrive with the queueing issue).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..domain.models import Job, JobState, NodeAssignment
from ..domain.snapshot import ClusterSnapshot
from .api import NodeView, Profile
from .plugins.fit import matching_free


@dataclass(frozen=True, slots=True)
class Decision:
    job_id: str
    assignments: tuple[NodeAssignment, ...]
    master_port: int


@dataclass(frozen=True, slots=True)
class Unplaced:
    job_id: str
    reason: str


@dataclass(frozen=True)
class PlacementResult:
    decisions: list[Decision]
    unplaced: list[Unplaced]


def pending_in_order(jobs: Mapping[str, Job]) -> list[Job]:
    pending = [j for j in jobs.values() if j.state is JobState.PENDING and not j.cancel_requested]
    return sorted(pending, key=lambda j: (-j.spec.priority, j.created_at, j.id))


def choose_master_port(job_id: str, attempt: int, used: set[int], port_range: tuple[int, int]) -> int:
    """A port on the rank-0 node that no live allocation there uses; spread by a hash of the job."""
    lo, hi = port_range
    span = hi - lo + 1
    start = zlib.crc32(f"{job_id}/{attempt}".encode()) % span
    for i in range(span):
        port = lo + (start + i) % span
        if port not in used:
            return port
    return lo + start  # every port taken: torch will report the clash on launch


def place(snapshot: ClusterSnapshot, profile: Profile, now: float,
          port_range: tuple[int, int] = (29500, 29999)) -> PlacementResult:
    used = snapshot.used_gpus()
    ports = snapshot.used_master_ports()
    free: dict[str, list[int]] = {}
    for node_id, node in snapshot.nodes.items():
        taken = used.get(node_id, set())
        free[node_id] = [g.index for g in node.gpus if g.healthy and g.index not in taken]

    decisions: list[Decision] = []
    unplaced: list[Unplaced] = []
    orphaned = frozenset(snapshot.orphans())
    for job in pending_in_order(snapshot.jobs):
        decision, reason = _place_one(job, snapshot, free, ports, profile, port_range, orphaned)
        if decision is None:
            unplaced.append(Unplaced(job.id, reason))
            continue
        for a in decision.assignments:
            free[a.node_id] = [i for i in free[a.node_id] if i not in a.gpu_indices]
        ports.setdefault(decision.assignments[0].node_id, set()).add(decision.master_port)
        decisions.append(decision)
    return PlacementResult(decisions, unplaced)


def _place_one(job: Job, snapshot: ClusterSnapshot, free: Mapping[str, Sequence[int]],
               ports: Mapping[str, set[int]], profile: Profile,
               port_range: tuple[int, int], orphaned: frozenset[str]) -> tuple[Decision | None, str]:
    res = job.spec.resources
    candidates: list[tuple[float, str, NodeView]] = []
    reasons: dict[str, int] = {}
    for node_id, node in snapshot.nodes.items():
        view = NodeView(node=node, free_gpus=tuple(free[node_id]), alive=node_id in snapshot.alive,
                        has_orphans=node_id in orphaned)
        rejected = next((r for f in profile.filters if (r := f.filter(job, view)) is not None), None)
        if rejected is not None:
            reasons[rejected] = reasons.get(rejected, 0) + 1
            continue
        score = sum(w * s.score(job, view) for s, w in profile.scorers)
        candidates.append((score, node_id, view))
    if len(candidates) < res.nodes:
        summary = ", ".join(f"{n} node(s): {r}" for r, n in sorted(reasons.items(), key=lambda x: -x[1]))
        return None, (f"waiting for {res.nodes} node(s) with {res.gpus_per_node} free GPU(s); "
                      f"{len(candidates)} fit now" + (f" ({summary})" if summary else ""))
    # Highest score first; node id breaks ties so the decision is deterministic.
    candidates.sort(key=lambda c: (-c[0], c[1]))
    chosen = sorted(candidates[: res.nodes], key=lambda c: c[1])
    assignments = []
    for node_rank, (_, node_id, view) in enumerate(chosen):
        gpus = tuple(sorted(matching_free(job, view))[: res.gpus_per_node])
        first = node_rank * res.gpus_per_node
        assignments.append(NodeAssignment(node_id=node_id, node_rank=node_rank, gpu_indices=gpus,
                                          ranks=tuple(range(first, first + res.gpus_per_node))))
    master = assignments[0].node_id
    port = choose_master_port(job.id, job.attempt, ports.get(master, set()), port_range)
    return Decision(job_id=job.id, assignments=tuple(assignments), master_port=port), ""
