"""Small builders for scheduler scenarios: `make_job(...)`, `make_node(...)`, `snapshot(...)`."""

from __future__ import annotations

from collections.abc import Iterable

from trainyard_scheduler.domain.models import Allocation, Gpu, Job, JobSpec, JobState, Node, Resources
from trainyard_scheduler.domain.snapshot import ClusterSnapshot

NOW = 1_700_000_000.0


def make_job(job_id: str = "job-1", *, nodes: int = 1, gpus: int = 1, accelerator: str = "", priority: int = 0,
             state: JobState = JobState.PENDING, created: float = NOW, team: str = "team-a",
             cancel_requested: bool = False) -> Job:
    spec = JobSpec(name=job_id, command=("python", "train.py"),
                   resources=Resources(nodes=nodes, gpus_per_node=gpus, accelerator=accelerator), priority=priority)
    return Job(id=job_id, spec=spec, state=state, team=team, user="u", created_at=created, updated_at=created,
               cancel_requested=cancel_requested)


def make_node(node_id: str, *, gpus: int = 8, model: str = "H100", unhealthy: Iterable[int] = (),
              cordoned: bool = False) -> Node:
    bad = set(unhealthy)
    return Node(node_id=node_id, hostname=node_id, agent_address=f"{node_id}:1", worker_address=f"{node_id}.host",
                gpus=tuple(Gpu(index=i, uuid=f"{node_id}-{i}", vendor="nvidia", model=model, memory_mb=80_000,
                               healthy=i not in bad) for i in range(gpus)),
                registered_at=NOW, cordoned=cordoned)


def snapshot(nodes: Iterable[Node], jobs: Iterable[Job] = (), allocations: Iterable[Allocation] = (),
             dead: Iterable[str] = ()) -> ClusterSnapshot:
    node_map = {n.node_id: n for n in nodes}
    job_map = {j.id: j for j in jobs}
    return ClusterSnapshot(nodes=node_map, alive=frozenset(node_map) - set(dead), jobs=job_map,
                           allocations={a.job_id: a for a in allocations},
                           job_revisions={j: 1 for j in job_map},
                           allocation_revisions={a.job_id: 1 for a in allocations})
