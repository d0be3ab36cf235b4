"""The scheduler's domain objects. Immutable: a change is a new object (`dataclasses.replace`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from trainyard_core.contract import (
    DEFAULT_PREEMPTION_SIGNAL,
    DEFAULT_QUEUE,
    DEFAULT_RESTART_BACKOFF_S,
    PLACEMENT_TIERS,
)
from trainyard_core.contract import JobState as JobState


@dataclass(frozen=True, slots=True)
class Resources:
    """What one gang needs. The accelerator may be named exactly (`accelerator`), as an any-of list
    (`accelerators`), or as a class (`min_memory_gb`, `min_compute_capability`, `vendor`); the scheduler
    picks the eligible model with the best expected throughput (speed factors, or the job's own
    `speed_hints`). A gang uses one model unless `allow_mixed` is set. `gpus_per_node == 0` is a CPU task:
    it goes to CPU-only nodes."""

    nodes: int
    gpus_per_node: int
    accelerator: str = ""
    accelerators: tuple[str, ...] = ()
    min_memory_gb: int = 0
    min_compute_capability: str = ""
    vendor: str = ""
    allow_mixed: bool = False
    cpus_per_node: int = 0
    speed_hints: Mapping[str, float] = field(default_factory=dict)

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def cpu_only(self) -> bool:
        return self.gpus_per_node == 0


# Topology tiers, lowest (closest) first. A gang's tier is the lowest domain that contains all of it.
TIERS: tuple[str, ...] = PLACEMENT_TIERS


@dataclass(frozen=True, slots=True)
class TopologyRequest:
    """`tier`: the domain the gang should fit in ("" = no constraint; the scheduler always packs as low as
    it can). `required`: wait as long as it takes for a placement within `tier`. Otherwise, with
    `wait_s > 0`, wait up to that long after queueing (Slurm's `--switches=N@time`), then take the best
    placement there is."""

    tier: str = ""
    required: bool = False
    wait_s: float = 0.0


@dataclass(frozen=True, slots=True)
class CheckpointPolicy:
    """What the job's checkpoint library is told (worker environment): save every `every_steps` steps
    and/or every `interval_s` seconds, and keep the last `keep_last` committed checkpoints (0: the
    store's default retention). The scheduler does not save anything itself."""

    every_steps: int = 0
    interval_s: float = 0.0
    keep_last: int = 0


@dataclass(frozen=True, slots=True)
class PreemptionPolicy:
    """How the job is asked to stop when preempted: `signal` first (a job that checkpoints on it can
    save its state), then SIGKILL after `grace_s` (0: the scheduler's default stop grace)."""

    signal: str = DEFAULT_PREEMPTION_SIGNAL
    grace_s: float = 0.0


@dataclass(frozen=True, slots=True)
class JobSpec:
    name: str
    command: tuple[str, ...]
    resources: Resources
    env: Mapping[str, str] = field(default_factory=dict)
    working_dir: str = ""
    queue: str = DEFAULT_QUEUE
    priority: int = 0
    max_restarts: int = 0
    labels: Mapping[str, str] = field(default_factory=dict)
    # "" = the scheduler's default class.
    priority_class: str = ""
    topology: TopologyRequest = TopologyRequest()
    preemption: PreemptionPolicy = PreemptionPolicy()
    # First restart waits this long; each further one twice as long (capped at 10 minutes).
    restart_backoff_s: float = DEFAULT_RESTART_BACKOFF_S
    # Wall-clock limit of one attempt (0: none). Also what backfill uses as the job's expected run time.
    time_limit_s: float = 0.0
    checkpoint: CheckpointPolicy = CheckpointPolicy()


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
    # The GPU model of this share ("" for a CPU task) and the CPUs it holds (0: not accounted).
    model: str = ""
    cpus: int = 0


# exit_code an agent reports for a worker whose end it could not learn (its shim died with it: the node's
# own supervision failed). Same value as the agent's EXIT_UNKNOWN.
EXIT_UNKNOWN = -1


@dataclass(frozen=True, slots=True)
class WorkerExit:
    rank: int
    node_id: str
    exit_code: int
    signal: int
    at: float
    # Ended by its agent's own shutdown (types.proto WorkerExit.agent_shutdown): the infrastructure's failure.
    agent_shutdown: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.signal == 0


@dataclass(frozen=True, slots=True)
class AttemptRecord:
    """One placed attempt of a job, appended to the job when its allocation is released (in the same etcd
    transaction): what the job's history shows of that attempt and what its usage record is made of."""

    attempt: int
    started_at: float          # the allocation was created (the gang placed)
    ended_at: float            # the allocation was released (every worker gone)
    nodes: tuple[str, ...]
    gpus: int
    cpus: int
    model: str                 # the gang's accelerator model, models joined by "+" when mixed; "" CPU-only
    outcome: str               # the state the job went to when the attempt ended
    reason: str = ""           # why the gang was stopped ("" when its workers all exited 0)


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
    # When the job last entered PENDING (submission, requeue after preemption or restart).
    queued_at: float = 0.0
    # Restarts used after failures (counted against spec.max_restarts); not after preemptions.
    restarts: int = 0
    # Restarts after infrastructure failures (node lost, GPU unhealthy); not counted against max_restarts.
    infra_restarts: int = 0
    # RESTARTING: not placed again before this time (backoff).
    not_before: float = 0.0
    # Ids of the jobs that preempted this one, oldest first (no preemption loops: never preempt them back).
    preempted_by: tuple[str, ...] = ()
    # Time of the job's latest committed checkpoint (None: none yet); lost work since is a preemption cost.
    last_checkpoint_at: float | None = None
    # Who asked for the cancel (the gateway's user, or tool:<name>); "" unless one was asked.
    cancelled_by: str = ""
    # Every attempt that was placed, oldest first (the last MAX_ATTEMPTS_KEPT; see jobs.end_attempt).
    attempts: tuple[AttemptRecord, ...] = ()
    # When the leader wrote the finished job to the history store; it leaves etcd job_ttl_s after it ended.
    archived_at: float | None = None
    # A digest of the record as archived (archive.content_digest): a write after the archive (a late rank's
    # exit) changes the record but not this, so the archiver writes the job to the history store again.
    archived_digest: str = ""
    # Who holds the (PENDING) job back from placement, and why ("" while it is not held; see operations.py).
    held_by: str = ""
    hold_reason: str = ""
    # Who asked for the placed job to be stopped and queued again ("" unless a requeue was asked).
    requeue_requested_by: str = ""
    # The submit's trace context (a W3C traceparent; "" for jobs submitted before traces were kept): the
    # cycle's decision, commit, launch and stop of the job are spans of that trace, and its log lines name it.
    trace_parent: str = ""


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
    # The stop reason is an infrastructure failure (a lost node, an unhealthy GPU): the job restarts
    # without using its restart budget.
    infra_failure: bool = False
    # Accounting for quotas, fair share and preemption: the job's team, its standing when placed, and
    # whether the gang ran on borrowed quota (then it may be reclaimed by the quota's owner).
    team: str = ""
    priority: tuple[int, int, int] = (0, 0, 0)
    borrowed: bool = False
    preemptible: bool = True
    # Set when the gang is stopped to make room for another job; its GPUs are held for that job.
    preempted_by: str = ""
    # Signal and grace of the stop (from the job's preemption policy when preempted).
    stop_signal: str = ""
    stop_grace_s: float = 0.0
    # Expected end (started + time limit) for backfill; None when the job has no time limit.
    expected_end: float | None = None
    # Set when the gang is stopped because someone asked for a requeue (who): the job goes back to PENDING.
    requeued_by: str = ""

    @property
    def world_size(self) -> int:
        return sum(len(a.ranks) for a in self.assignments)

    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(a.node_id for a in self.assignments)

    @property
    def gpus(self) -> int:
        return sum(len(a.gpu_indices) for a in self.assignments)


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


# A node's state as the API names it (types.proto NodeState, lower case): the node answer's `state` and the
# scheduler's nodes_by_state metric read it from here. Cordoned wins over liveness: it says why no gang goes there.
NODE_STATES: tuple[str, ...] = ("ready", "not_ready", "cordoned")


def node_state(node: Node, alive: bool) -> str:
    return "cordoned" if node.cordoned else ("ready" if alive else "not_ready")
