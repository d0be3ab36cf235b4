"""The only place where scheduler protobuf messages and domain objects meet."""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

from trainyard.agent.v1 import agent_pb2
from trainyard.common.v1 import types_pb2
from trainyard_core.errors import InvalidArgument

from ..domain.models import (
    Allocation,
    Gpu,
    GpuLink,
    Job,
    JobSpec,
    JobState,
    Node,
    NodeAssignment,
    Resources,
    WorkerExit,
)
from ..launch import NodeLaunch

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


def _ts(seconds: float | None) -> Timestamp | None:
    if seconds is None:
        return None
    ts = Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def _seconds(ts: Timestamp) -> float:
    return ts.ToNanoseconds() / 1e9


def spec_from_pb(pb: types_pb2.JobSpec) -> JobSpec:
    r = pb.resources
    return JobSpec(name=pb.name, command=tuple(pb.command), env=dict(pb.env),
                   resources=Resources(nodes=r.nodes, gpus_per_node=r.gpus_per_node, accelerator=r.accelerator),
                   working_dir=pb.working_dir, queue=pb.queue or "default", priority=pb.priority,
                   max_restarts=pb.max_restarts, labels=dict(pb.labels))


def spec_to_pb(spec: JobSpec) -> types_pb2.JobSpec:
    return types_pb2.JobSpec(
        name=spec.name, command=list(spec.command), env=dict(spec.env),
        resources=types_pb2.Resources(nodes=spec.resources.nodes, gpus_per_node=spec.resources.gpus_per_node,
                                      accelerator=spec.resources.accelerator),
        working_dir=spec.working_dir, queue=spec.queue, priority=spec.priority,
        max_restarts=spec.max_restarts, labels=dict(spec.labels))


def state_from_pb(value: int) -> JobState:
    try:
        return _STATE_FROM_PB[value]  # type: ignore[index]
    except KeyError:
        raise InvalidArgument(f"unknown job state {value}") from None


def _assignment_pb(a: NodeAssignment) -> types_pb2.NodeAssignment:
    return types_pb2.NodeAssignment(node_id=a.node_id, node_rank=a.node_rank, gpu_indices=list(a.gpu_indices),
                                    ranks=list(a.ranks))


def _exit_pb(e: WorkerExit) -> types_pb2.WorkerExit:
    return types_pb2.WorkerExit(rank=e.rank, node_id=e.node_id, exit_code=e.exit_code, signal=e.signal,
                                exited_at=_ts(e.at))


def job_to_pb(job: Job, alloc: Allocation | None = None) -> types_pb2.Job:
    """The API view of a job; while it runs, exits come from its live allocation."""
    exits = job.exits or (tuple(sorted(alloc.exits, key=lambda e: e.rank)) if alloc else ())
    return types_pb2.Job(
        id=job.id, spec=spec_to_pb(job.spec), state=_STATE_TO_PB[job.state], team=job.team, user=job.user,
        created_at=_ts(job.created_at), updated_at=_ts(job.updated_at), attempt=job.attempt,
        exit_code=job.exit_code, message=job.message, cancel_requested=job.cancel_requested,
        placement=[_assignment_pb(a) for a in job.placement], exits=[_exit_pb(e) for e in exits],
        events=[types_pb2.JobEvent(at=_ts(e.at), kind=e.kind, message=e.message) for e in job.events],
        started_at=_ts(job.started_at), finished_at=_ts(job.finished_at))


def exit_from_pb(pb: types_pb2.WorkerExit, node_id: str, now: float) -> WorkerExit:
    if pb.rank < 0:
        raise InvalidArgument(f"exit.rank must be >= 0, got {pb.rank}")
    at = _seconds(pb.exited_at) if pb.HasField("exited_at") else now
    return WorkerExit(rank=pb.rank, node_id=node_id, exit_code=pb.exit_code, signal=pb.signal, at=at)


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


def node_to_pb(node: Node, *, alive: bool, allocated: set[int], last_heartbeat: float | None) -> types_pb2.Node:
    if node.cordoned:
        state = types_pb2.NODE_STATE_CORDONED
    else:
        state = types_pb2.NODE_STATE_READY if alive else types_pb2.NODE_STATE_NOT_READY
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
        working_dir=launch.working_dir, leader_epoch=epoch,
        workers=[agent_pb2.WorkerSpec(rank=w.rank, local_rank=w.local_rank, gpu_indices=list(w.gpu_indices))
                 for w in launch.workers])
