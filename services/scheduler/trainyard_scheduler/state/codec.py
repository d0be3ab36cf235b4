"""Records ↔ JSON bytes for etcd. Versioned (`"v": 1`) so later fields can be added compatibly."""

from __future__ import annotations

from typing import Any

import orjson

from ..domain.models import (
    Allocation,
    AttemptRecord,
    CheckpointPolicy,
    Gpu,
    GpuLink,
    Job,
    JobEvent,
    JobSpec,
    JobState,
    Node,
    NodeAssignment,
    PreemptionPolicy,
    Resources,
    TopologyRequest,
    WorkerExit,
)
from ..domain.queues import FairShareUsage, QueueConfig, QuotaLimit, TeamQuota


def _dump(obj: dict[str, Any]) -> bytes:
    # orjson: the gang commit's encoding was most of its cost beside etcd's own (8x faster than json here).
    return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)


def _assignment(a: NodeAssignment) -> dict[str, Any]:
    return {"node_id": a.node_id, "node_rank": a.node_rank, "gpus": list(a.gpu_indices),
            "ranks": list(a.ranks), "model": a.model, "cpus": a.cpus}


def _assignment_from(d: dict[str, Any]) -> NodeAssignment:
    return NodeAssignment(node_id=d["node_id"], node_rank=d["node_rank"], gpu_indices=tuple(d["gpus"]),
                          ranks=tuple(d["ranks"]), model=d.get("model", ""), cpus=d.get("cpus", 0))


def _resources(r: Resources) -> dict[str, Any]:
    return {"nodes": r.nodes, "gpus_per_node": r.gpus_per_node, "accelerator": r.accelerator,
            "accelerators": list(r.accelerators), "min_memory_gb": r.min_memory_gb,
            "min_cc": r.min_compute_capability, "vendor": r.vendor, "allow_mixed": r.allow_mixed,
            "cpus_per_node": r.cpus_per_node, "speed_hints": dict(r.speed_hints)}


def _resources_from(r: dict[str, Any]) -> Resources:
    return Resources(nodes=r["nodes"], gpus_per_node=r["gpus_per_node"], accelerator=r.get("accelerator", ""),
                     accelerators=tuple(r.get("accelerators", ())), min_memory_gb=r.get("min_memory_gb", 0),
                     min_compute_capability=r.get("min_cc", ""), vendor=r.get("vendor", ""),
                     allow_mixed=r.get("allow_mixed", False), cpus_per_node=r.get("cpus_per_node", 0),
                     speed_hints=r.get("speed_hints", {}))


def _exit(e: WorkerExit) -> dict[str, Any]:
    out = {"rank": e.rank, "node_id": e.node_id, "code": e.exit_code, "signal": e.signal, "at": e.at}
    if e.agent_shutdown:
        out["agent_shutdown"] = True
    return out


def _exit_from(d: dict[str, Any]) -> WorkerExit:
    return WorkerExit(rank=d["rank"], node_id=d["node_id"], exit_code=d["code"], signal=d["signal"],
                      at=d["at"], agent_shutdown=d.get("agent_shutdown", False))


def encode_job(job: Job) -> bytes:
    s = job.spec
    return _dump({
        "v": 1, "id": job.id, "state": job.state.value, "team": job.team, "user": job.user,
        "created_at": job.created_at, "updated_at": job.updated_at, "attempt": job.attempt,
        "exit_code": job.exit_code, "message": job.message, "cancel_requested": job.cancel_requested,
        "started_at": job.started_at, "finished_at": job.finished_at,
        "spec": {"name": s.name, "command": list(s.command), "env": dict(s.env),
                 "resources": _resources(s.resources),
                 "working_dir": s.working_dir, "queue": s.queue, "priority": s.priority,
                 "max_restarts": s.max_restarts, "labels": dict(s.labels), "priority_class": s.priority_class,
                 "topology": {"tier": s.topology.tier, "required": s.topology.required,
                              "wait_s": s.topology.wait_s},
                 "preemption": {"signal": s.preemption.signal, "grace_s": s.preemption.grace_s},
                 "restart_backoff_s": s.restart_backoff_s, "time_limit_s": s.time_limit_s,
                 "checkpoint": {"every_steps": s.checkpoint.every_steps, "interval_s": s.checkpoint.interval_s,
                                "keep_last": s.checkpoint.keep_last}},
        "queued_at": job.queued_at, "restarts": job.restarts, "infra_restarts": job.infra_restarts,
        "cancelled_by": job.cancelled_by,
        "not_before": job.not_before,
        "preempted_by": list(job.preempted_by),
        "placement": [_assignment(a) for a in job.placement],
        "exits": [_exit(e) for e in job.exits],
        "events": [{"at": e.at, "kind": e.kind, "message": e.message} for e in job.events],
        "attempts": [_attempt(a) for a in job.attempts],
        "archived_at": job.archived_at,
        "archived_digest": job.archived_digest,
        # Written only when set, so a record without them encodes (and digests: archive.content_digest) as before.
        **_set(held_by=job.held_by, hold_reason=job.hold_reason, requeue_requested_by=job.requeue_requested_by,
               trace_parent=job.trace_parent),
    })


def _set(**fields: str) -> dict[str, str]:
    return {k: v for k, v in fields.items() if v}


def _attempt(a: AttemptRecord) -> dict[str, Any]:
    return {"attempt": a.attempt, "started_at": a.started_at, "ended_at": a.ended_at, "nodes": list(a.nodes),
            "gpus": a.gpus, "cpus": a.cpus, "model": a.model, "outcome": a.outcome, "reason": a.reason}


def _attempt_from(d: dict[str, Any]) -> AttemptRecord:
    return AttemptRecord(attempt=d["attempt"], started_at=d["started_at"], ended_at=d["ended_at"],
                         nodes=tuple(d["nodes"]), gpus=d["gpus"], cpus=d["cpus"], model=d["model"],
                         outcome=d["outcome"], reason=d.get("reason", ""))


def decode_job(raw: bytes) -> Job:
    d = orjson.loads(raw)
    s = d["spec"]
    t = s.get("topology", {})
    pre = s.get("preemption", {})
    spec = JobSpec(name=s["name"], command=tuple(s["command"]), env=s["env"],
                   resources=_resources_from(s["resources"]),
                   working_dir=s.get("working_dir", ""), queue=s.get("queue", "default"),
                   priority=s.get("priority", 0), max_restarts=s.get("max_restarts", 0),
                   labels=s.get("labels", {}), priority_class=s.get("priority_class", ""),
                   topology=TopologyRequest(tier=t.get("tier", ""), required=t.get("required", False),
                                            wait_s=t.get("wait_s", 0.0)),
                   preemption=PreemptionPolicy(signal=pre.get("signal", "SIGTERM"), grace_s=pre.get("grace_s", 0.0)),
                   restart_backoff_s=s.get("restart_backoff_s", 10.0), time_limit_s=s.get("time_limit_s", 0.0),
                   checkpoint=CheckpointPolicy(**s.get("checkpoint", {})))
    return Job(id=d["id"], spec=spec, state=JobState(d["state"]), team=d["team"], user=d["user"],
               created_at=d["created_at"], updated_at=d["updated_at"], attempt=d.get("attempt", 1),
               exit_code=d.get("exit_code", 0), message=d.get("message", ""),
               cancel_requested=d.get("cancel_requested", False),
               placement=tuple(_assignment_from(a) for a in d.get("placement", [])),
               exits=tuple(_exit_from(e) for e in d.get("exits", [])),
               events=tuple(JobEvent(at=e["at"], kind=e["kind"], message=e["message"])
                            for e in d.get("events", [])),
               started_at=d.get("started_at"), finished_at=d.get("finished_at"),
               queued_at=d.get("queued_at", d["created_at"]), restarts=d.get("restarts", 0),
               infra_restarts=d.get("infra_restarts", 0), cancelled_by=d.get("cancelled_by", ""),
               not_before=d.get("not_before", 0.0), preempted_by=tuple(d.get("preempted_by", ())),
               attempts=tuple(_attempt_from(a) for a in d.get("attempts", ())),
               archived_at=d.get("archived_at"), archived_digest=d.get("archived_digest", ""),
               held_by=d.get("held_by", ""), hold_reason=d.get("hold_reason", ""),
               requeue_requested_by=d.get("requeue_requested_by", ""), trace_parent=d.get("trace_parent", ""))


def encode_allocation(a: Allocation) -> bytes:
    return _dump({
        "v": 1, "job_id": a.job_id, "attempt": a.attempt,
        "assignments": [_assignment(x) for x in a.assignments],
        "master_addr": a.master_addr, "master_port": a.master_port, "created_at": a.created_at,
        "launched": sorted(a.launched), "stopped": sorted(a.stopped),
        "exits": [_exit(e) for e in a.exits], "stop_reason": a.stop_reason, "infra_failure": a.infra_failure,
        "team": a.team, "priority": list(a.priority), "borrowed": a.borrowed, "preemptible": a.preemptible,
        "preempted_by": a.preempted_by, "stop_signal": a.stop_signal, "stop_grace_s": a.stop_grace_s,
        "expected_end": a.expected_end, **_set(requeued_by=a.requeued_by),
    })


def decode_allocation(raw: bytes) -> Allocation:
    d = orjson.loads(raw)
    return Allocation(job_id=d["job_id"], attempt=d["attempt"],
                      assignments=tuple(_assignment_from(x) for x in d["assignments"]),
                      master_addr=d["master_addr"], master_port=d["master_port"],
                      created_at=d["created_at"], launched=frozenset(d.get("launched", [])),
                      stopped=frozenset(d.get("stopped", [])),
                      exits=tuple(_exit_from(e) for e in d.get("exits", [])),
                      stop_reason=d.get("stop_reason", ""), infra_failure=d.get("infra_failure", False),
                      team=d.get("team", ""),
                      priority=_standing(d.get("priority", (0, 0, 0))), borrowed=d.get("borrowed", False),
                      preemptible=d.get("preemptible", True), preempted_by=d.get("preempted_by", ""),
                      stop_signal=d.get("stop_signal", ""), stop_grace_s=d.get("stop_grace_s", 0.0),
                      expected_end=d.get("expected_end"), requeued_by=d.get("requeued_by", ""))


def _standing(v: Any) -> tuple[int, int, int]:
    a, b, c = [*list(v), 0, 0, 0][:3]
    return int(a), int(b), int(c)


def encode_node(n: Node) -> bytes:
    return _dump({
        "v": 1, "node_id": n.node_id, "hostname": n.hostname, "agent_address": n.agent_address,
        "worker_address": n.worker_address, "registered_at": n.registered_at, "labels": dict(n.labels),
        "cordoned": n.cordoned, "cpus": n.cpus, "memory_mb": n.memory_mb,
        "driver_version": n.driver_version, "simulated": n.simulated, "cuda_version": n.cuda_version,
        "cordon_reason": n.cordon_reason,
        "links": [[x.gpu_a, x.gpu_b, x.level, x.nvlinks] for x in n.gpu_links],
        "gpus": [{"index": g.index, "uuid": g.uuid, "vendor": g.vendor, "model": g.model,
                  "memory_mb": g.memory_mb, "healthy": g.healthy, "health_reason": g.health_reason,
                  "health_action": g.health_action, "cc": g.compute_capability, "pci": g.pci_bus_id,
                  "numa": g.numa_node, "island": g.nvlink_island}
                 for g in n.gpus],
    })


def decode_node(raw: bytes) -> Node:
    d = orjson.loads(raw)
    return Node(node_id=d["node_id"], hostname=d["hostname"], agent_address=d["agent_address"],
                worker_address=d["worker_address"], registered_at=d["registered_at"],
                labels=d.get("labels", {}), cordoned=d.get("cordoned", False), cpus=d.get("cpus", 0),
                memory_mb=d.get("memory_mb", 0), driver_version=d.get("driver_version", ""),
                simulated=d.get("simulated", False), cuda_version=d.get("cuda_version", ""),
                cordon_reason=d.get("cordon_reason", ""),
                gpu_links=tuple(GpuLink(a, b, level, nv) for a, b, level, nv in d.get("links", [])),
                gpus=tuple(Gpu(index=g["index"], uuid=g["uuid"], vendor=g["vendor"], model=g["model"],
                               memory_mb=g["memory_mb"], healthy=g.get("healthy", True),
                               health_reason=g.get("health_reason", ""),
                               health_action=g.get("health_action", "none"), compute_capability=g.get("cc", ""),
                               pci_bus_id=g.get("pci", ""), numa_node=g.get("numa", -1),
                               nvlink_island=g.get("island", -1)) for g in d["gpus"]))


def encode_queue(q: QueueConfig) -> bytes:
    return _dump({"v": 1, "name": q.name, "tier": q.tier, "node_labels": dict(q.node_labels),
                  "max_gpus": q.max_gpus, "description": q.description})


def decode_queue(raw: bytes) -> QueueConfig:
    d = orjson.loads(raw)
    return QueueConfig(name=d["name"], tier=d.get("tier", 0), node_labels=d.get("node_labels", {}),
                       max_gpus=d.get("max_gpus", 0), description=d.get("description", ""))


def encode_quota(q: TeamQuota) -> bytes:
    return _dump({"v": 1, "team": q.team, "weight": q.weight,
                  "limits": {m: {"nominal": x.nominal, "borrow_limit": x.borrow_limit} for m, x in q.limits.items()}})


def decode_quota(raw: bytes) -> TeamQuota:
    d = orjson.loads(raw)
    return TeamQuota(team=d["team"], weight=d.get("weight", 1.0),
                     limits={m: QuotaLimit(nominal=x["nominal"], borrow_limit=x.get("borrow_limit"))
                             for m, x in d.get("limits", {}).items()})


def encode_usage(u: FairShareUsage) -> bytes:
    return _dump({"v": 1, "at": u.at, "by_team": {t: dict(row) for t, row in u.by_team.items()}})


def decode_usage(raw: bytes) -> FairShareUsage:
    d = orjson.loads(raw)
    return FairShareUsage(at=d.get("at", 0.0), by_team=d.get("by_team", {}))
