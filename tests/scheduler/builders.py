"""Small builders for scheduler scenarios: `make_job(...)`, `make_node(...)`, `fleet(...)`, `running(...)`,
`snapshot(...)`. Every argument has a plain default so a scenario names only what it is about."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from trainyard_scheduler.domain.models import (
    Allocation,
    Gpu,
    Job,
    JobSpec,
    JobState,
    Node,
    NodeAssignment,
    PreemptionPolicy,
    Resources,
    TopologyRequest,
)
from trainyard_scheduler.domain.queues import PolicyConfig, QuotaLimit, TeamQuota, standing
from trainyard_scheduler.domain.snapshot import ClusterSnapshot

NOW = 1_700_000_000.0


def make_job(job_id: str = "job-1", *, nodes: int = 1, gpus: int = 1, accelerator: str = "",
             accelerators: Sequence[str] = (), min_memory_gb: int = 0, vendor: str = "", min_cc: str = "",
             allow_mixed: bool = False, cpus: int = 0, speed_hints: Mapping[str, float] | None = None,
             priority: int = 0, priority_class: str = "", queue: str = "default",
             state: JobState = JobState.PENDING, created: float = NOW, team: str = "team-a",
             cancel_requested: bool = False, time_limit: float = 0.0, tier: str = "", required: bool = False,
             wait_s: float = 0.0, preempted_by: Sequence[str] = (), max_restarts: int = 0,
             signal: str = "SIGTERM", grace_s: float = 0.0) -> Job:
    spec = JobSpec(name=job_id, command=("python", "train.py"),
                   resources=Resources(nodes=nodes, gpus_per_node=gpus, accelerator=accelerator,
                                       accelerators=tuple(accelerators), min_memory_gb=min_memory_gb, vendor=vendor,
                                       min_compute_capability=min_cc, allow_mixed=allow_mixed, cpus_per_node=cpus,
                                       speed_hints=dict(speed_hints or {})),
                   priority=priority, priority_class=priority_class, queue=queue, time_limit_s=time_limit,
                   topology=TopologyRequest(tier=tier, required=required, wait_s=wait_s),
                   max_restarts=max_restarts, preemption=PreemptionPolicy(signal=signal, grace_s=grace_s))
    return Job(id=job_id, spec=spec, state=state, team=team, user="u", created_at=created, updated_at=created,
               cancel_requested=cancel_requested, queued_at=created, preempted_by=tuple(preempted_by))


def make_node(node_id: str, *, gpus: int = 8, model: str = "H100", vendor: str = "nvidia", memory_mb: int = 80_000,
              cc: str = "9.0", unhealthy: Iterable[int] = (), cordoned: bool = False, leaf: str = "",
              spine: str = "", zone: str = "", cpus: int = 64, islands: Sequence[int] | None = None,
              labels: Mapping[str, str] | None = None) -> Node:
    bad = set(unhealthy)
    node_labels = dict(labels or {})
    for key, value in (("switch", leaf), ("spine", spine), ("zone", zone)):
        if value:
            node_labels[key] = value
    return Node(node_id=node_id, hostname=node_id, agent_address=f"{node_id}:1", worker_address=f"{node_id}.host",
                gpus=tuple(Gpu(index=i, uuid=f"{node_id}-{i}", vendor=vendor, model=model, memory_mb=memory_mb,
                               healthy=i not in bad, compute_capability=cc,
                               nvlink_island=islands[i] if islands is not None else 0) for i in range(gpus)),
                registered_at=NOW, cordoned=cordoned, labels=node_labels, cpus=cpus)


def fleet(*, spines: int = 1, leaves: int = 1, per_leaf: int = 4, gpus: int = 8, model: str = "H100",
          prefix: str = "n", vendor: str = "nvidia") -> list[Node]:
    """A regular fleet: `spines` x `leaves` leaf switches x `per_leaf` nodes, named n-<spine><leaf>-<i>."""
    return [make_node(f"{prefix}-{s}{chr(97 + lf)}-{i}", gpus=gpus, model=model, vendor=vendor,
                      leaf=f"leaf-{s}{chr(97 + lf)}", spine=f"spine-{s}")
            for s in range(spines) for lf in range(leaves) for i in range(per_leaf)]


def running(job: Job, shares: Sequence[tuple[str, Sequence[int]]], *, borrowed: bool = False,
            config: PolicyConfig | None = None, started: float = NOW - 100, expected_end: float | None = None,
            preemptible: bool = True, model: str = "H100", stop_reason: str = "",
            preempted_by: str = "") -> tuple[Job, Allocation]:
    """The job as RUNNING and its allocation over `shares` [(node, gpu indices)]."""
    config = config or PolicyConfig()
    assignments = []
    rank = 0
    for i, (node_id, gpus) in enumerate(shares):
        assignments.append(NodeAssignment(node_id, i, tuple(gpus), tuple(range(rank, rank + len(gpus))), model=model))
        rank += len(gpus)
    spec = job.spec
    alloc = Allocation(job_id=job.id, attempt=job.attempt, assignments=tuple(assignments), master_addr="x",
                       master_port=29500, created_at=started, team=job.team,
                       priority=standing(spec.queue, spec.priority_class, spec.priority, config), borrowed=borrowed,
                       preemptible=preemptible, expected_end=expected_end, stop_reason=stop_reason,
                       preempted_by=preempted_by)
    return replace(job, state=JobState.RUNNING, started_at=started, placement=tuple(assignments)), alloc


def quota(team: str, weight: float = 1.0, **limits: tuple[int, int | None]) -> TeamQuota:
    """quota("team-a", H100=(8, None)) — model names with '-' can be passed via `limits`."""
    return TeamQuota(team=team, weight=weight, limits={m: QuotaLimit(n, b) for m, (n, b) in limits.items()})


def snapshot(nodes: Iterable[Node], jobs: Iterable[Job] = (), allocations: Iterable[Allocation] = (),
             dead: Iterable[str] = ()) -> ClusterSnapshot:
    node_map = {n.node_id: n for n in nodes}
    job_map = {j.id: j for j in jobs}
    allocs = list(allocations)
    return ClusterSnapshot(nodes=node_map, alive=frozenset(node_map) - set(dead), jobs=job_map,
                           allocations={a.job_id: a for a in allocs},
                           job_revisions={j: 1 for j in job_map},
                           allocation_revisions={a.job_id: 1 for a in allocs})
