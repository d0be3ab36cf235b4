"""The only pb ↔ API-model mapping of the gateway (jobs, nodes, queues, quotas, log lines, tokens)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import cast, get_args

from google.protobuf.descriptor import EnumDescriptor
from google.protobuf.timestamp_pb2 import Timestamp

from trainyard.agent.v1 import agent_pb2
from trainyard.common.v1 import types_pb2
from trainyard.gateway.v1 import gateway_pb2
from trainyard.scheduler.v1 import audit_pb2, scheduler_pb2, usage_pb2
from trainyard_core import audit
from trainyard_core.contract import DEFAULT_RESTART_BACKOFF_S, JobState, Role

from .schemas import jobs as js
from .schemas import metrics as ms
from .schemas import nodes as ns
from .schemas import queues as qs
from .schemas import quotas
from .schemas.logs import LogLine
from .schemas.pending import PendingJob, PendingList
from .schemas.tokens import Token
from .schemas.usage import UsageAmount, UsageReport, UsageRow
from .tokens import TokenRecord

_JOB_STATES = frozenset(js.JOB_STATE_NAMES)
_NODE_STATES = frozenset(get_args(ns.NodeState))
_GPU_HEALTH = frozenset(get_args(ns.GpuHealth))
_GPU_EVENT_KINDS = frozenset(get_args(ms.GpuEventKind))
TERMINAL_EXIT_STATES = frozenset({JobState.SUCCEEDED.value, JobState.FAILED.value})


def _enum_name(value: int, enum: str, all_names: frozenset[str], descriptor: EnumDescriptor) -> str:
    item = descriptor.values_by_number.get(value)
    if item is None:
        return "unknown"
    short = item.name.removeprefix(enum + "_").lower()
    return short if short in all_names else "unknown"


def _time(ts: Timestamp) -> datetime | None:
    if ts.seconds == 0 and ts.nanos == 0:
        return None
    return ts.ToDatetime(tzinfo=UTC)


def job_state_name(value: int) -> str:
    return _enum_name(value, "JOB_STATE", _JOB_STATES, types_pb2.JobState.DESCRIPTOR)


def job_state_from_name(name: str) -> int:
    """'running' → JOB_STATE_RUNNING; ValueError for names that are not states."""
    if name not in _JOB_STATES or name == "unknown":
        raise ValueError(name)
    return int(types_pb2.JobState.Value("JOB_STATE_" + name.upper()))


def spec_to_pb(spec: js.JobSubmit) -> types_pb2.JobSpec:
    r = spec.resources
    return types_pb2.JobSpec(
        name=spec.name, command=spec.command, env=spec.env,
        resources=types_pb2.Resources(nodes=r.nodes, gpus_per_node=r.gpus_per_node, accelerator=r.accelerator,
                                      accelerators=r.accelerators, min_memory_gb=r.min_memory_gb,
                                      min_compute_capability=r.min_compute_capability, vendor=r.vendor,
                                      allow_mixed=r.allow_mixed, cpus_per_node=r.cpus_per_node,
                                      speed_hints=r.speed_hints),
        working_dir=spec.working_dir, queue=spec.queue, priority=spec.priority,
        max_restarts=spec.max_restarts, labels=spec.labels, priority_class=spec.priority_class,
        topology=types_pb2.TopologyRequest(tier=spec.topology.tier, required=spec.topology.required,
                                           wait_s=spec.topology.wait_s),
        preemption=types_pb2.PreemptionPolicy(signal=spec.preemption.signal, grace_s=spec.preemption.grace_s),
        restart_backoff_s=spec.restart_backoff_s, time_limit_s=spec.time_limit_s,
        checkpoint=types_pb2.CheckpointPolicy(every_steps=spec.checkpoint.every_steps,
                                              interval_s=spec.checkpoint.interval_s,
                                              keep_last=spec.checkpoint.keep_last))


def spec_from_pb(spec: types_pb2.JobSpec) -> js.JobSpec:
    r = spec.resources
    return js.JobSpec(
        name=spec.name, command=list(spec.command), env=dict(spec.env),
        resources=js.Resources(nodes=r.nodes, gpus_per_node=r.gpus_per_node, accelerator=r.accelerator,
                               accelerators=list(r.accelerators), min_memory_gb=r.min_memory_gb,
                               min_compute_capability=r.min_compute_capability, vendor=r.vendor,
                               allow_mixed=r.allow_mixed, cpus_per_node=r.cpus_per_node,
                               speed_hints=dict(r.speed_hints)),
        working_dir=spec.working_dir, queue=spec.queue, priority=spec.priority,
        max_restarts=spec.max_restarts, labels=dict(spec.labels), priority_class=spec.priority_class,
        topology=js.Topology(tier=spec.topology.tier, required=spec.topology.required,
                             wait_s=spec.topology.wait_s),
        preemption=js.Preemption(signal=spec.preemption.signal, grace_s=spec.preemption.grace_s),
        # Only an older scheduler leaves it unset; it used the default.
        restart_backoff_s=spec.restart_backoff_s if spec.HasField("restart_backoff_s") else DEFAULT_RESTART_BACKOFF_S,
        time_limit_s=spec.time_limit_s,
        checkpoint=js.Checkpoint(every_steps=spec.checkpoint.every_steps, interval_s=spec.checkpoint.interval_s,
                                 keep_last=spec.checkpoint.keep_last))


def job_from_pb(job: types_pb2.Job) -> js.Job:
    state = job_state_name(job.state)
    return js.Job(
        id=job.id, name=job.spec.name, state=state, team=job.team, user=job.user,
        spec=spec_from_pb(job.spec), attempt=job.attempt,
        exit_code=job.exit_code if state in TERMINAL_EXIT_STATES else None,
        message=job.message, cancel_requested=job.cancel_requested,
        placement=[js.NodeAssignment(node_id=a.node_id, node_rank=a.node_rank, gpu_indices=list(a.gpu_indices),
                                     ranks=list(a.ranks), model=a.model, cpus=a.cpus) for a in job.placement],
        exits=[js.WorkerExit(rank=e.rank, node_id=e.node_id, exit_code=e.exit_code, signal=e.signal,
                             exited_at=_time(e.exited_at)) for e in job.exits],
        events=[js.JobEvent(at=_time(e.at), kind=e.kind, message=e.message) for e in job.events],
        created_at=_time(job.created_at), updated_at=_time(job.updated_at),
        started_at=_time(job.started_at), finished_at=_time(job.finished_at), restarts=job.restarts,
        infra_restarts=job.infra_restarts,
        queued_at=_time(job.queued_at), not_before=_time(job.not_before), preempted_by=list(job.preempted_by),
        last_checkpoint_at=_time(job.last_checkpoint_at), cancelled_by=job.cancelled_by,
        attempts=[js.JobAttempt(attempt=a.attempt, started_at=_time(a.started_at), ended_at=_time(a.ended_at),
                                nodes=list(a.nodes), gpus=a.gpus, cpus=a.cpus, model=a.model,
                                outcome=job_state_name(a.outcome), reason=a.reason) for a in job.attempts],
        held_by=job.held_by, hold_reason=job.hold_reason, requeue_requested_by=job.requeue_requested_by)


def queue_to_pb(name: str, body: qs.QueuePut) -> types_pb2.QueueConfig:
    return types_pb2.QueueConfig(name=name, tier=body.tier, node_labels=body.node_labels, max_gpus=body.max_gpus,
                                 description=body.description)


def queue_from_pb(queue: types_pb2.QueueConfig) -> qs.Queue:
    return qs.Queue(name=queue.name, tier=queue.tier, node_labels=dict(queue.node_labels), max_gpus=queue.max_gpus,
                    description=queue.description)


def quota_to_pb(team: str, body: quotas.QuotaPut) -> types_pb2.TeamQuota:
    return types_pb2.TeamQuota(team=team, weight=body.weight, limits={
        model: types_pb2.QuotaLimit(nominal=limit.nominal, borrow_limit=limit.borrow_limit)
        for model, limit in body.limits.items()})


def quota_from_pb(quota: types_pb2.TeamQuota) -> quotas.Quota:
    return quotas.Quota(
        team=quota.team, weight=quota.weight if quota.HasField("weight") else 1.0,
        limits={model: quotas.QuotaLimit(nominal=x.nominal,
                                         borrow_limit=x.borrow_limit if x.HasField("borrow_limit") else None)
                for model, x in quota.limits.items()},
        use={key: quotas.QuotaUse(in_use=u.in_use, borrowed=u.borrowed) for key, u in sorted(quota.use.items())})


def node_from_pb(node: types_pb2.Node) -> ns.Node:
    state = cast(ns.NodeState, _enum_name(node.state, "NODE_STATE", _NODE_STATES, types_pb2.NodeState.DESCRIPTOR))
    allocated = set(node.allocated_gpus)
    schedulable = state == "ready" and not node.cordoned
    gpus = [ns.Gpu(index=g.index, uuid=g.uuid, vendor=g.vendor, model=g.model, memory_mb=g.memory_mb,
                   compute_capability=g.compute_capability,
                   health=cast(ns.GpuHealth, _enum_name(g.health, "GPU_HEALTH", _GPU_HEALTH,
                                                        types_pb2.GpuHealth.DESCRIPTOR)),
                   health_reason=g.health_reason, health_action=g.health_action or "none",
                   numa_node=g.numa_node, nvlink_island=g.nvlink_island,
                   allocated=g.index in allocated) for g in node.gpus]
    free = sum(1 for g in gpus if schedulable and not g.allocated and g.health in ("healthy", "unknown"))
    return ns.Node(
        node_id=node.node_id, hostname=node.hostname, agent_address=node.agent_address, state=state,
        cordoned=node.cordoned, cordon_reason=node.cordon_reason, gpus_total=len(gpus), gpus_free=free,
        models=sorted({g.model for g in gpus if g.model}), gpus=gpus, cpus=node.cpus, memory_mb=node.memory_mb,
        labels=dict(node.labels), driver_version=node.driver_version, simulated=node.simulated,
        registered_at=_time(node.registered_at), last_heartbeat=_time(node.last_heartbeat))


def _gpu_health_name(value: int) -> ns.GpuHealth:
    return cast(ns.GpuHealth, _enum_name(value, "GPU_HEALTH", _GPU_HEALTH, types_pb2.GpuHealth.DESCRIPTOR))


def _unix_ms(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


def node_metrics_from_pb(node_id: str, window_s: int, reply: agent_pb2.GetGpuMetricsResponse) -> ms.NodeMetrics:
    return ms.NodeMetrics(
        node_id=node_id, window_s=window_s, interval_s=reply.interval_ms / 1000, as_of=_unix_ms(reply.now_unix_ms),
        retained_since=_unix_ms(reply.retained_since_unix_ms) if reply.retained_since_unix_ms else None,
        gpus=[ms.GpuSeries(index=g.gpu_index, samples=[
            ms.GpuSample(time=_unix_ms(p.time_unix_ms), utilization_percent=p.utilization_percent,
                         memory_used_mb=p.memory_used_mb, temperature_c=p.temperature_c, power_w=p.power_w,
                         sm_clock_mhz=p.sm_clock_mhz) for p in g.samples]) for g in reply.gpus],
        # A kind of event this gateway does not know yet (a newer agent's) is left out.
        events=[ms.GpuHealthEvent(time=_unix_ms(e.time_unix_ms), gpu=e.gpu_index,
                                  kind=cast(ms.GpuEventKind, e.kind), xid=e.xid,
                                  health=_gpu_health_name(e.health), reason=e.reason)
                for e in reply.events if e.kind in _GPU_EVENT_KINDS])


def log_line_from_pb(line: agent_pb2.LogLine) -> LogLine:
    return LogLine(rank=line.rank, attempt=line.attempt, stream=line.stream, text=line.text, seq=line.seq,
                   time_ms=line.time_unix_ms)


def _utc(t: float) -> datetime:
    return datetime.fromtimestamp(t, tz=UTC)


def token_to_schema(record: TokenRecord) -> Token:
    return Token(token_id=record.token_id, team=record.team, user=record.user, role=record.role.value,
                 created_at=_utc(record.created_at),
                 expires_at=None if record.expires_at is None else _utc(record.expires_at),
                 scopes=[s.value for s in record.scopes], description=record.description, legacy=record.legacy)


def job_query_to_pb(query: js.JobQuery, *, page_size: int, page_token: str) -> scheduler_pb2.ListJobsRequest:
    def when(t: datetime | None) -> Timestamp | None:
        if t is None:
            return None
        ts = Timestamp()
        ts.FromDatetime(t)
        return ts

    return scheduler_pb2.ListJobsRequest(
        page_size=page_size, page_token=page_token, team=query.team, user=query.user, queue=query.queue,
        states=[job_state_from_name(s) for s in query.states], labels=dict(query.labels),  # type: ignore[misc]
        name_prefix=query.name_prefix, submitted_after=when(query.submitted_after),
        submitted_before=when(query.submitted_before), finished_after=when(query.finished_after),
        finished_before=when(query.finished_before))


def _pb_time(t: float) -> Timestamp:
    ts = Timestamp()
    ts.FromDatetime(_utc(t))
    return ts


def token_to_pb(record: TokenRecord) -> gateway_pb2.TokenInfo:
    info = gateway_pb2.TokenInfo(token_id=record.token_id, team=record.team, user=record.user,
                                 admin=record.role is Role.OPERATOR, role=record.role.value,
                                 created_at=_pb_time(record.created_at), scopes=[s.value for s in record.scopes],
                                 description=record.description, legacy=record.legacy)
    if record.expires_at is not None:
        info.expires_at.CopyFrom(_pb_time(record.expires_at))
    return info


# --- usage ---------------------------------------------------------------------------------------------------

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _exact_pb_time(t: datetime) -> Timestamp:
    """Every microsecond of `t`, over the whole range of RFC 3339 times (FromDatetime refuses those an offset
    puts before 0001-01-01T00:00:00Z, which a window's end may be)."""
    delta = t - _EPOCH
    return Timestamp(seconds=delta.days * 86400 + delta.seconds, nanos=delta.microseconds * 1000)


def usage_request_to_pb(*, since: datetime, until: datetime, group_by: str, team: str,
                        limit: int) -> usage_pb2.GetUsageRequest:
    return usage_pb2.GetUsageRequest(since=_exact_pb_time(since), until=_exact_pb_time(until), group_by=group_by,
                                     team=team, limit=limit)


def _amount(r: usage_pb2.UsageRow) -> dict[str, float]:
    return {"gpu_hours": r.gpu_hours, "cpu_hours": r.cpu_hours, "cost": r.cost,
            "unpriced_gpu_hours": r.unpriced_gpu_hours}


def usage_from_pb(pb: usage_pb2.GetUsageResponse, *, since: datetime, until: datetime, team: str) -> UsageReport:
    """The report for the window as the caller named it (`since`, `until`: the scheduler's copy of them is
    the same instants, in UTC)."""
    return UsageReport.model_validate({
        "from": since, "to": until, "group_by": pb.group_by, "team": team, "currency": pb.currency,
        "prices": dict(pb.prices), "rows": [UsageRow(group=r.group, **_amount(r)) for r in pb.rows],
        "groups": pb.groups, "total": UsageAmount(**_amount(pb.total)), "unpriced_models": list(pb.unpriced_models),
        "computed_at": pb.computed_at.ToDatetime(tzinfo=UTC)})


def _pb_seconds(t: float) -> Timestamp:
    whole = int(t // 1)
    return Timestamp(seconds=whole, nanos=min(999_999_999, round((t - whole) * 1e9)))


def audit_request_to_pb(flt: audit.AuditFilter, *, page_size: int,
                        page_token: str) -> audit_pb2.ListAuditEntriesRequest:
    pb = audit_pb2.ListAuditEntriesRequest(
        principal=flt.principal, user=flt.user, team=flt.team, action=flt.action, target=flt.target,
        result=flt.result, request_id=flt.request_id, page_size=page_size, page_token=page_token)
    if flt.since is not None:
        pb.since.CopyFrom(_pb_seconds(flt.since))
    if flt.until is not None:
        pb.until.CopyFrom(_pb_seconds(flt.until))
    return pb


def audit_page_from_pb(pb: audit_pb2.ListAuditEntriesResponse) -> audit.AuditPage:
    return audit.AuditPage(entries=[audit.AuditEntry(
        id=e.id, time=e.time.seconds + e.time.nanos / 1e9, principal=e.principal, role=e.role, service=e.service,
        action=e.action, target=e.target, team=e.team, result=e.result, message=e.message, request_id=e.request_id,
        detail=dict(e.detail)) for e in pb.entries], next_page_token=pb.next_page_token)


def pending_from_pb(pb: scheduler_pb2.ListPendingResponse) -> PendingList:
    return PendingList(
        jobs=[PendingJob(job_id=j.job_id, team=j.team, user=j.user, queue=j.queue, position=j.position,
                         queue_length=j.queue_length, reason=j.reason, held=j.held,
                         queued_at=_time(j.queued_at)) for j in pb.jobs],
        total=pb.total, as_of=_time(pb.as_of))
