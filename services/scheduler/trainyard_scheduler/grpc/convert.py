"""The only place where scheduler protobuf messages and domain objects meet."""

from __future__ import annotations

import dataclasses
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from trainyard.agent.v1 import agent_pb2
from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2
from trainyard_core.errors import InvalidArgument

from ..domain.listing import JobFilter
from ..domain.models import (
    Allocation,
    AttemptRecord,
    CheckpointPolicy,
    Gpu,
    GpuLink,
    Job,
    JobSpec,
    JobState,
    Node,
    NodeAssignment,
    PreemptionPolicy,
    Resources,
    TopologyRequest,
    WorkerExit,
    node_state,
)
from ..domain.pending import PendingEntry, PendingOrder
from ..domain.queues import QueueConfig, QuotaLimit, TeamQuota
from ..launch import NodeLaunch


# Proto3 cannot tell an unset string or number from its zero value; these are the domain's defaults for
# the fields where zero is not the default (restart_backoff_s is `optional` so that 0 stays expressible).
def _default(cls: Any, name: str) -> Any:
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


DEFAULT_QUEUE: str = _default(JobSpec, "queue")
DEFAULT_SIGNAL: str = _default(PreemptionPolicy, "signal")
DEFAULT_RESTART_BACKOFF_S: float = _default(JobSpec, "restart_backoff_s")
DEFAULT_WEIGHT: float = _default(TeamQuota, "weight")

_STATE_TO_PB = {
    JobState.PENDING: types_pb2.JOB_STATE_PENDING,
    JobState.ADMITTED: types_pb2.JOB_STATE_ADMITTED,
    JobState.RUNNING: types_pb2.JOB_STATE_RUNNING,
    JobState.SUCCEEDED: types_pb2.JOB_STATE_SUCCEEDED,
    JobState.FAILED: types_pb2.JOB_STATE_FAILED,
    JobState.CANCELLED: types_pb2.JOB_STATE_CANCELLED,
    JobState.PREEMPTED: types_pb2.JOB_STATE_PREEMPTED,
    JobState.RESTARTING: types_pb2.JOB_STATE_RESTARTING,
}
_STATE_FROM_PB = {v: k for k, v in _STATE_TO_PB.items()}
_STATE_VALUES = frozenset(s.value for s in JobState)


def _ts(seconds: float | None) -> Timestamp | None:
    if seconds is None:
        return None
    ts = Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def _seconds(ts: Timestamp) -> float:
    return ts.ToNanoseconds() / 1e9


def resources_from_pb(r: types_pb2.Resources) -> Resources:
    return Resources(nodes=r.nodes, gpus_per_node=r.gpus_per_node, accelerator=r.accelerator,
                     accelerators=tuple(r.accelerators), min_memory_gb=r.min_memory_gb,
                     min_compute_capability=r.min_compute_capability, vendor=r.vendor, allow_mixed=r.allow_mixed,
                     cpus_per_node=r.cpus_per_node, speed_hints=dict(r.speed_hints))


def resources_to_pb(r: Resources) -> types_pb2.Resources:
    return types_pb2.Resources(nodes=r.nodes, gpus_per_node=r.gpus_per_node, accelerator=r.accelerator,
                               accelerators=list(r.accelerators), min_memory_gb=r.min_memory_gb,
                               min_compute_capability=r.min_compute_capability, vendor=r.vendor,
                               allow_mixed=r.allow_mixed, cpus_per_node=r.cpus_per_node,
                               speed_hints=dict(r.speed_hints))


def spec_from_pb(pb: types_pb2.JobSpec) -> JobSpec:
    return JobSpec(name=pb.name, command=tuple(pb.command), env=dict(pb.env),
                   resources=resources_from_pb(pb.resources),
                   working_dir=pb.working_dir, queue=pb.queue or DEFAULT_QUEUE, priority=pb.priority,
                   max_restarts=pb.max_restarts, labels=dict(pb.labels), priority_class=pb.priority_class,
                   topology=TopologyRequest(tier=pb.topology.tier, required=pb.topology.required,
                                            wait_s=pb.topology.wait_s),
                   preemption=PreemptionPolicy(signal=pb.preemption.signal or DEFAULT_SIGNAL,
                                               grace_s=pb.preemption.grace_s),
                   restart_backoff_s=(pb.restart_backoff_s if pb.HasField("restart_backoff_s")
                                      else DEFAULT_RESTART_BACKOFF_S),
                   time_limit_s=pb.time_limit_s,
                   checkpoint=CheckpointPolicy(every_steps=pb.checkpoint.every_steps,
                                               interval_s=pb.checkpoint.interval_s,
                                               keep_last=pb.checkpoint.keep_last))


def spec_to_pb(spec: JobSpec) -> types_pb2.JobSpec:
    return types_pb2.JobSpec(
        name=spec.name, command=list(spec.command), env=dict(spec.env), resources=resources_to_pb(spec.resources),
        working_dir=spec.working_dir, queue=spec.queue, priority=spec.priority,
        max_restarts=spec.max_restarts, labels=dict(spec.labels), priority_class=spec.priority_class,
        topology=types_pb2.TopologyRequest(tier=spec.topology.tier, required=spec.topology.required,
                                           wait_s=spec.topology.wait_s),
        preemption=types_pb2.PreemptionPolicy(signal=spec.preemption.signal, grace_s=spec.preemption.grace_s),
        restart_backoff_s=spec.restart_backoff_s, time_limit_s=spec.time_limit_s,
        checkpoint=types_pb2.CheckpointPolicy(every_steps=spec.checkpoint.every_steps,
                                              interval_s=spec.checkpoint.interval_s,
                                              keep_last=spec.checkpoint.keep_last))


def state_from_pb(value: int) -> JobState:
    try:
        return _STATE_FROM_PB[value]  # type: ignore[index]
    except KeyError:
        raise InvalidArgument(f"unknown job state {value}") from None


def job_filter_from_pb(request: scheduler_pb2.ListJobsRequest, team: str) -> JobFilter:
    """The filter of a ListJobs request, scoped to `team` (the caller's, decided by the servicer)."""
    def bound(name: str) -> float | None:
        return _seconds(getattr(request, name)) if request.HasField(name) else None  # type: ignore[arg-type]

    return JobFilter(team=team, user=request.user, states=frozenset(state_from_pb(s).value for s in request.states),
                     queue=request.queue, labels=dict(request.labels), name_prefix=request.name_prefix,
                     submitted_after=bound("submitted_after"), submitted_before=bound("submitted_before"),
                     finished_after=bound("finished_after"), finished_before=bound("finished_before"))


def _assignment_pb(a: NodeAssignment) -> types_pb2.NodeAssignment:
    return types_pb2.NodeAssignment(node_id=a.node_id, node_rank=a.node_rank, gpu_indices=list(a.gpu_indices),
                                    ranks=list(a.ranks), model=a.model, cpus=a.cpus)


def _exit_pb(e: WorkerExit) -> types_pb2.WorkerExit:
    return types_pb2.WorkerExit(rank=e.rank, node_id=e.node_id, exit_code=e.exit_code, signal=e.signal,
                                exited_at=_ts(e.at), agent_shutdown=e.agent_shutdown)


def job_to_pb(job: Job, alloc: Allocation | None = None) -> types_pb2.Job:
    """The API view of a job; while it runs, exits come from its live allocation."""
    exits = job.exits or (tuple(sorted(alloc.exits, key=lambda e: e.rank)) if alloc else ())
    return types_pb2.Job(
        id=job.id, spec=spec_to_pb(job.spec), state=_STATE_TO_PB[job.state], team=job.team, user=job.user,
        created_at=_ts(job.created_at), updated_at=_ts(job.updated_at), attempt=job.attempt,
        exit_code=job.exit_code, message=job.message, cancel_requested=job.cancel_requested,
        placement=[_assignment_pb(a) for a in job.placement], exits=[_exit_pb(e) for e in exits],
        events=[types_pb2.JobEvent(at=_ts(e.at), kind=e.kind, message=e.message) for e in job.events],
        started_at=_ts(job.started_at), finished_at=_ts(job.finished_at), restarts=job.restarts,
        infra_restarts=job.infra_restarts, queued_at=_ts(job.queued_at or job.created_at),
        cancelled_by=job.cancelled_by,
        not_before=_ts(job.not_before or None),
        preempted_by=list(job.preempted_by), last_checkpoint_at=_ts(job.last_checkpoint_at),
        attempts=[_attempt_pb(a) for a in job.attempts], held_by=job.held_by, hold_reason=job.hold_reason,
        requeue_requested_by=job.requeue_requested_by)


def _attempt_pb(a: AttemptRecord) -> types_pb2.JobAttempt:
    outcome = _STATE_TO_PB.get(JobState(a.outcome)) if a.outcome in _STATE_VALUES else None
    return types_pb2.JobAttempt(attempt=a.attempt, started_at=_ts(a.started_at), ended_at=_ts(a.ended_at),
                                nodes=list(a.nodes), gpus=a.gpus, cpus=a.cpus, model=a.model,
                                outcome=outcome or types_pb2.JOB_STATE_UNSPECIFIED, reason=a.reason)


def queue_from_pb(pb: types_pb2.QueueConfig) -> QueueConfig:
    return QueueConfig(name=pb.name, tier=pb.tier, node_labels=dict(pb.node_labels), max_gpus=pb.max_gpus,
                       description=pb.description)


def queue_to_pb(q: QueueConfig) -> types_pb2.QueueConfig:
    return types_pb2.QueueConfig(name=q.name, tier=q.tier, node_labels=dict(q.node_labels), max_gpus=q.max_gpus,
                                 description=q.description)


def quota_from_pb(pb: types_pb2.TeamQuota) -> TeamQuota:
    limits = {model: QuotaLimit(nominal=x.nominal,
                                borrow_limit=x.borrow_limit if x.HasField("borrow_limit") else None)
              for model, x in pb.limits.items()}
    return TeamQuota(team=pb.team, limits=limits, weight=pb.weight if pb.HasField("weight") else DEFAULT_WEIGHT)


def quota_to_pb(q: TeamQuota) -> types_pb2.TeamQuota:
    return types_pb2.TeamQuota(
        team=q.team, weight=q.weight,
        limits={model: types_pb2.QuotaLimit(nominal=x.nominal, borrow_limit=x.borrow_limit)
                for model, x in q.limits.items()})


def exit_from_pb(pb: types_pb2.WorkerExit, node_id: str, now: float) -> WorkerExit:
    if pb.rank < 0:
        raise InvalidArgument(f"exit.rank must be >= 0, got {pb.rank}")
    at = _seconds(pb.exited_at) if pb.HasField("exited_at") else now
    return WorkerExit(rank=pb.rank, node_id=node_id, exit_code=pb.exit_code, signal=pb.signal, at=at,
                      agent_shutdown=pb.agent_shutdown)


def gpu_from_pb(g: types_pb2.Gpu) -> Gpu:
    # Degraded GPUs stay schedulable; only UNHEALTHY ones are taken out of placement.
    action = g.health_action or "none"
    if action not in HEALTH_ACTIONS:
        raise InvalidArgument(f"gpu {g.index}: health_action {action!r} is not one of "
                              f"{', '.join(sorted(HEALTH_ACTIONS))}")
    return Gpu(index=g.index, uuid=g.uuid, vendor=g.vendor, model=g.model, memory_mb=g.memory_mb,
               healthy=g.health != types_pb2.GPU_HEALTH_UNHEALTHY, health_reason=g.health_reason,
               health_action=action, compute_capability=g.compute_capability, pci_bus_id=g.pci_bus_id,
               numa_node=g.numa_node, nvlink_island=g.nvlink_island)


HEALTH_ACTIONS = frozenset({"none", "ignore", "restart_job", "reset_gpu", "drain_node", "reboot_host"})


def node_from_pb(pb: types_pb2.Node, now: float) -> Node:
    gpus = tuple(gpu_from_pb(g) for g in pb.gpus)
    if len({g.index for g in gpus}) != len(gpus):
        raise InvalidArgument("node.gpus has duplicate indices")
    if any(g.index < 0 for g in gpus):
        raise InvalidArgument("node.gpus indices must be >= 0")
    if not pb.agent_address or ":" not in pb.agent_address:
        raise InvalidArgument("node.agent_address must be host:port")
    indices = {g.index for g in gpus}
    links = tuple(GpuLink(x.gpu_a, x.gpu_b, x.level, x.nvlinks) for x in pb.gpu_links)
    if any(x.gpu_a not in indices or x.gpu_b not in indices for x in links):
        raise InvalidArgument("node.gpu_links names a GPU index the node does not have")
    return Node(node_id=pb.node_id, hostname=pb.hostname or pb.node_id, agent_address=pb.agent_address,
                worker_address=pb.worker_address or pb.agent_address.rsplit(":", 1)[0], gpus=gpus,
                registered_at=now, labels=dict(pb.labels), cordoned=pb.cordoned, cpus=pb.cpus,
                memory_mb=pb.memory_mb, driver_version=pb.driver_version, simulated=pb.simulated,
                cuda_version=pb.cuda_version, gpu_links=links)


_NODE_STATE = {"ready": types_pb2.NODE_STATE_READY, "not_ready": types_pb2.NODE_STATE_NOT_READY,
               "cordoned": types_pb2.NODE_STATE_CORDONED}


def node_state_pb(node: Node, alive: bool) -> types_pb2.NodeState.ValueType:
    return _NODE_STATE[node_state(node, alive)]


def node_to_pb(node: Node, *, alive: bool, allocated: set[int], last_heartbeat: float | None) -> types_pb2.Node:
    state = node_state_pb(node, alive)
    return types_pb2.Node(
        node_id=node.node_id, hostname=node.hostname, agent_address=node.agent_address,
        worker_address=node.worker_address, cpus=node.cpus, memory_mb=node.memory_mb, labels=dict(node.labels),
        state=state, cordoned=node.cordoned, registered_at=_ts(node.registered_at),
        last_heartbeat=_ts(last_heartbeat), allocated_gpus=sorted(allocated),
        driver_version=node.driver_version, simulated=node.simulated, cuda_version=node.cuda_version,
        cordon_reason=node.cordon_reason,
        gpu_links=[types_pb2.GpuLink(gpu_a=x.gpu_a, gpu_b=x.gpu_b, level=x.level, nvlinks=x.nvlinks)
                   for x in node.gpu_links],
        gpus=[types_pb2.Gpu(index=g.index, uuid=g.uuid, vendor=g.vendor, model=g.model, memory_mb=g.memory_mb,
                            health=types_pb2.GPU_HEALTH_HEALTHY if g.healthy else types_pb2.GPU_HEALTH_UNHEALTHY,
                            health_reason=g.health_reason, health_action=g.health_action,
                            compute_capability=g.compute_capability, pci_bus_id=g.pci_bus_id,
                            numa_node=g.numa_node, nvlink_island=g.nvlink_island) for g in node.gpus])


def launch_to_pb(launch: NodeLaunch, epoch: int) -> agent_pb2.LaunchWorkersRequest:
    return agent_pb2.LaunchWorkersRequest(
        job_id=launch.job_id, attempt=launch.attempt, command=list(launch.command), env=launch.env,
        working_dir=launch.working_dir, leader_epoch=epoch, team=launch.team,
        workers=[agent_pb2.WorkerSpec(rank=w.rank, local_rank=w.local_rank, gpu_indices=list(w.gpu_indices))
                 for w in launch.workers])


def pending_to_pb(order: PendingOrder, entries: list[PendingEntry], total: int) -> scheduler_pb2.ListPendingResponse:
    return scheduler_pb2.ListPendingResponse(
        jobs=[scheduler_pb2.PendingJob(job_id=e.job_id, team=e.team, user=e.user, queue=e.queue, position=e.position,
                                       queue_length=order.lengths.get(e.queue, 0), reason=e.reason, held=e.held,
                                       queued_at=_ts(e.queued_at)) for e in entries],
        total=total, as_of=_ts(order.as_of or None))
