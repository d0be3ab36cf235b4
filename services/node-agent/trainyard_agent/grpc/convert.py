"""The only place where the agent's domain objects meet protobuf, in both directions."""

from __future__ import annotations

import signal
from collections.abc import Iterable, Sequence

from google.protobuf.timestamp_pb2 import Timestamp

from trainyard.agent.v1 import agent_pb2
from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2
from trainyard_core.errors import InvalidArgument

from ..gpu_history import HistoryWindow
from ..model import Accelerator, GpuLink, Health, NodeInfo, RunningAllocation
from ..workers.credentials import Credential
from ..workers.model import LaunchRequest, LaunchResult, LogLine, LogQuery, WorkerExit, WorkerSpec, WorkerStatus

_HEALTH = {
    Health.HEALTHY: types_pb2.GPU_HEALTH_HEALTHY,
    Health.DEGRADED: types_pb2.GPU_HEALTH_DEGRADED,
    Health.UNHEALTHY: types_pb2.GPU_HEALTH_UNHEALTHY,
}


def timestamp(seconds: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


# --- to the scheduler ------------------------------------------------------------------------------------


def gpu_to_pb(gpu: Accelerator) -> types_pb2.Gpu:
    return types_pb2.Gpu(index=gpu.index, uuid=gpu.uuid, vendor=gpu.vendor.value, model=gpu.model,
                         memory_mb=gpu.memory_mb, pci_bus_id=gpu.pci_bus_id, compute_capability=gpu.capability,
                         health=_HEALTH[gpu.health], health_reason=gpu.health_reason, numa_node=gpu.numa_node,
                         nvlink_island=gpu.nvlink_island, health_action=gpu.wire_action,
                         cpu_affinity=list(gpu.cpu_affinity), mig_enabled=gpu.mig_enabled)


def link_to_pb(link: GpuLink) -> types_pb2.GpuLink:
    return types_pb2.GpuLink(gpu_a=link.gpu_a, gpu_b=link.gpu_b, level=link.level, nvlinks=link.nvlinks)


def node_to_pb(node: NodeInfo) -> types_pb2.Node:
    return types_pb2.Node(node_id=node.node_id, hostname=node.hostname, agent_address=node.agent_address,
                          worker_address=node.worker_address, gpus=[gpu_to_pb(g) for g in node.accelerators],
                          cpus=node.cpus, memory_mb=node.memory_mb, labels=node.labels,
                          driver_version=node.driver_version, simulated=node.simulated,
                          cuda_version=node.cuda_version, gpu_links=[link_to_pb(x) for x in node.gpu_links])


def running_to_pb(running: Iterable[RunningAllocation]) -> list[scheduler_pb2.RunningAllocation]:
    return [scheduler_pb2.RunningAllocation(job_id=r.job_id, attempt=r.attempt, ranks=list(r.ranks))
            for r in running]


def register_request(node: NodeInfo, running: Iterable[RunningAllocation]) -> scheduler_pb2.RegisterNodeRequest:
    return scheduler_pb2.RegisterNodeRequest(node=node_to_pb(node), running=running_to_pb(running))


def heartbeat_request(*, node_id: str, seq: int, sent_at: float, changed_gpus: Sequence[Accelerator],
                      running: Iterable[RunningAllocation], pulses: bool = False) -> scheduler_pb2.HeartbeatRequest:
    """A beat: changes only. GPU metrics are not sent (the agent's Prometheus endpoint has them). `pulses`:
    ask for a pulse session (the leader answers the stream's first beat with one)."""
    return scheduler_pb2.HeartbeatRequest(node_id=node_id, seq=seq, sent_at=timestamp(sent_at),
                                          gpus=[gpu_to_pb(g) for g in changed_gpus],
                                          running=running_to_pb(running), pulses=pulses)


def exit_report(node_id: str, exit: WorkerExit) -> scheduler_pb2.ReportWorkerExitRequest:
    return scheduler_pb2.ReportWorkerExitRequest(
        node_id=node_id, job_id=exit.job_id, attempt=exit.attempt,
        exit=types_pb2.WorkerExit(rank=exit.rank, node_id=node_id, exit_code=exit.exit_code, signal=exit.signal,
                                  exited_at=timestamp(exit.exited_at), agent_shutdown=exit.agent_shutdown))


# --- AgentService ------------------------------------------------------------------------------------------


def launch_from_pb(req: agent_pb2.LaunchWorkersRequest) -> LaunchRequest:
    return LaunchRequest(
        job_id=req.job_id, attempt=req.attempt, command=tuple(req.command), env=dict(req.env),
        working_dir=req.working_dir, leader_epoch=req.leader_epoch, team=req.team,
        workers=tuple(WorkerSpec(rank=w.rank, local_rank=w.local_rank, gpu_indices=tuple(w.gpu_indices))
                      for w in req.workers))


def credential_from_pb(req: agent_pb2.RenewJobCredentialRequest) -> Credential:
    if not req.HasField("credential"):
        raise InvalidArgument("credential is required: the attempt's renewed cert_chain, key and ca (PEM)")
    c = req.credential
    return Credential(cert_chain=c.cert_chain, key=c.key, ca=c.ca)


def launch_result_to_pb(result: LaunchResult) -> agent_pb2.LaunchWorkersResponse:
    return agent_pb2.LaunchWorkersResponse(pids=list(result.pids), already_running=result.already_running)


def grace_from_pb(grace_period_ms: int) -> float | None:
    """Seconds of grace; None (the agent's default) when the request leaves it at 0."""
    if grace_period_ms < 0:
        raise InvalidArgument(f"grace_period_ms must be >= 0, got {grace_period_ms}")
    return grace_period_ms / 1000 if grace_period_ms else None


STOP_SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT, "SIGUSR1": signal.SIGUSR1,
                "SIGUSR2": signal.SIGUSR2, "SIGHUP": signal.SIGHUP}


def stop_signal_from_pb(name: str) -> signal.Signals:
    """The first signal of a stop; "" means SIGTERM."""
    if not name:
        return signal.SIGTERM
    try:
        return STOP_SIGNALS[name.upper()]
    except KeyError:
        raise InvalidArgument(f"signal {name!r} is not allowed; use one of {', '.join(STOP_SIGNALS)}") from None


def worker_status_to_pb(s: WorkerStatus) -> agent_pb2.WorkerStatus:
    return agent_pb2.WorkerStatus(job_id=s.job_id, attempt=s.attempt, rank=s.rank, pid=s.pid, running=s.running,
                                  exit_code=s.exit_code, signal=s.signal)


def log_query_from_pb(req: agent_pb2.GetWorkerLogsRequest) -> LogQuery:
    if not req.job_id:
        raise InvalidArgument("job_id is required")
    for name in ("attempt", "tail_lines", "since_unix_ms"):
        if getattr(req, name) < 0:
            raise InvalidArgument(f"{name} must be >= 0, got {getattr(req, name)}")
    if req.after_seq and not req.attempt:
        raise InvalidArgument("after_seq needs attempt: a seq numbers the lines of one attempt and rank")
    for rank, seq in req.after_seq.items():
        if rank < 0 or seq < 0:
            raise InvalidArgument(f"after_seq: ranks and seqs must be >= 0, got {rank}: {seq}")
    return LogQuery(job_id=req.job_id, attempt=req.attempt, tail_lines=req.tail_lines, since_ms=req.since_unix_ms,
                    after_seq=dict(req.after_seq))


def log_lines_to_pb(lines: Iterable[LogLine]) -> list[agent_pb2.LogLine]:
    return [agent_pb2.LogLine(rank=line.rank, stream=line.stream, text=line.text, attempt=line.attempt,
                              seq=line.seq, time_unix_ms=line.time_ms)
            for line in lines]


def gpu_history_to_pb(w: HistoryWindow) -> agent_pb2.GetGpuMetricsResponse:
    return agent_pb2.GetGpuMetricsResponse(
        gpus=[agent_pb2.GpuSeries(gpu_index=index, samples=[
            agent_pb2.GpuSample(time_unix_ms=p.time_ms, utilization_percent=p.utilization_percent,
                                memory_used_mb=p.memory_used_mb, temperature_c=p.temperature_c, power_w=p.power_w,
                                sm_clock_mhz=p.sm_clock_mhz) for p in points])
              for index, points in w.gpus.items()],
        events=[agent_pb2.GpuHealthEvent(time_unix_ms=e.time_ms, gpu_index=e.gpu, kind=e.kind, xid=e.xid,
                                         health=_HEALTH[e.health], reason=e.reason) for e in w.events],
        interval_ms=round(w.interval_s * 1000), retained_since_unix_ms=w.retained_since_ms, now_unix_ms=w.now_ms)
