"""The scheduler's domain objects. Immutable: a change is a new object (`dataclasses.replace`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum


class JobState(StrEnum):
    PENDING = "pending"
    ADMITTED = "admitted"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    PREEMPTED = "preempted"
    RESTARTING = "restarting"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


@dataclass(frozen=True, slots=True)
class Resources:
    nodes: int
    gpus_per_node: int
    accelerator: str = ""

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True, slots=True)
class JobSpec:
    name: str
    command: tuple[str, ...]
    resources: Resources
    env: Mapping[str, str] = field(default_factory=dict)
    working_dir: str = ""
    queue: str = "default"
    priority: int = 0
    max_restarts: int = 0
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class JobEvent:
    at: float
    kind: str
    message: str


@dataclass(frozen=True, slots=True)
class NodeAssignment:
    """One node's share of a gang: which GPUs, which global ranks (one rank per GPU)."""

    node_id: str
    node_rank: int
    gpu_indices: tuple[int, ...]
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class WorkerExit:
    rank: int
    node_id: str
    exit_code: int
    signal: int
    at: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.signal == 0


@dataclass(frozen=True, slots=True)
class Job:
    id: str
    spec: JobSpec
    state: JobState
    team: str
    user: str
    created_at: float
    updated_at: float
    # Attempts count from 1; 0 means "every attempt" in the agents' and gateway's log APIs.
    attempt: int = 1
    exit_code: int = 0
    message: str = ""
    cancel_requested: bool = False
    placement: tuple[NodeAssignment, ...] = ()
    exits: tuple[WorkerExit, ...] = ()
    events: tuple[JobEvent, ...] = ()
    started_at: float | None = None
    finished_at: float | None = None


@dataclass(frozen=True, slots=True)
class Allocation:
    """The one record per placed gang. Its GPUs are taken until the record is deleted, which happens
    only after every worker is known to have exited or been stopped: no GPU is ever in two gangs."""

    job_id: str
    attempt: int
    assignments: tuple[NodeAssignment, ...]
    master_addr: str
    master_port: int
    created_at: float
    # Nodes whose agent confirmed the launch / the stop of this gang's workers.
    launched: frozenset[str] = frozenset()
    stopped: frozenset[str] = frozenset()
    exits: tuple[WorkerExit, ...] = ()
    # Why the gang is being stopped ("" while it should run).
    stop_reason: str = ""

    @property
    def world_size(self) -> int:
        return sum(len(a.ranks) for a in self.assignments)

    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(a.node_id for a in self.assignments)


# Health-policy actions (decided by the node agent's policy table) that take the whole node out of service.
NODE_ACTIONS = frozenset({"drain_node", "reboot_host"})


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int
    uuid: str
    vendor: str
    model: str
    memory_mb: int
    healthy: bool = True
    health_reason: str = ""
    # "none", "restart_job", "reset_gpu", "drain_node" or "reboot_host" (the agent's policy).
    health_action: str = "none"
    compute_capability: str = ""
    pci_bus_id: str = ""
    numa_node: int = -1
    nvlink_island: int = -1


@dataclass(frozen=True, slots=True)
class GpuLink:
    gpu_a: int
    gpu_b: int
    level: str
    nvlinks: int = 0


@dataclass(frozen=True, slots=True)
class Node:
    node_id: str
    hostname: str
    agent_address: str
    worker_address: str
    gpus: tuple[Gpu, ...]
    registered_at: float
    labels: Mapping[str, str] = field(default_factory=dict)
    cordoned: bool = False
    cpus: int = 0
    memory_mb: int = 0
    driver_version: str = ""
    simulated: bool = False
    cuda_version: str = ""
    gpu_links: tuple[GpuLink, ...] = ()
    cordon_reason: str = ""

    def unhealthy_gpus(self) -> frozenset[int]:
        return frozenset(g.index for g in self.gpus if not g.healthy)
