"""Human output: aligned tables, ages, job details. Machine output is `--json` (see commands)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, TextIO


def print_json(value: Any, out: TextIO | None = None) -> None:
    print(json.dumps(value, indent=2, sort_keys=False), file=out or sys.stdout)


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], out: TextIO | None = None) -> None:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    stream = out or sys.stdout
    for row in (headers, *rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip(), file=stream)


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def age(value: str | None, now: datetime | None = None) -> str:
    """'42s', '5m', '3h', '2d' since `value` (ISO 8601); '-' when unknown."""
    when = parse_time(value)
    if when is None:
        return "-"
    seconds = max(0, int(((now or datetime.now(UTC)) - when).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def local_time(value: str | None) -> str:
    when = parse_time(value)
    return when.astimezone().strftime("%Y-%m-%d %H:%M:%S") if when else "-"


def gpus(job: dict[str, Any]) -> str:
    r = job.get("spec", {}).get("resources", {})
    nodes, per = r.get("nodes", 0), r.get("gpus_per_node", 0)
    models = r.get("accelerator") or "|".join(r.get("accelerators") or [])
    return f"{nodes}x{per}" + (f" {models}" if models else "")


def duration(seconds: float) -> str:
    """5400 → '1h30m', 90 → '1m30s', 0.5 → '0.5s'."""
    if seconds < 60 and seconds != int(seconds):
        return f"{seconds:g}s"
    left = int(seconds)
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if left >= size:
            parts.append(f"{left // size}{unit}")
            left %= size
    return "".join(parts) or "0s"


def accelerators(r: dict[str, Any]) -> str:
    """What a job accepts, in words: 'H100 or A100, >= 80 GB, nvidia' or 'any model'."""
    if r.get("gpus_per_node") == 0:
        return "no GPU (CPU task)"
    parts = [r.get("accelerator") or " or ".join(r.get("accelerators") or []) or "any model"]
    if r.get("min_memory_gb"):
        parts.append(f">= {r['min_memory_gb']} GB")
    if r.get("min_compute_capability"):
        parts.append(f"cc >= {r['min_compute_capability']}")
    if r.get("vendor"):
        parts.append(r["vendor"])
    if r.get("allow_mixed"):
        parts.append("models may mix")
    return ", ".join(parts)


def jobs_table(jobs: Sequence[dict[str, Any]], out: TextIO | None = None) -> None:
    rows = [[j["id"], j["name"], j["state"], gpus(j), f"{j['team']}/{j['user']}", age(j.get("created_at"))]
            for j in jobs]
    table(["ID", "NAME", "STATE", "GPUS", "TEAM/USER", "AGE"], rows, out)


def nodes_table(nodes: Sequence[dict[str, Any]], out: TextIO | None = None) -> None:
    rows = []
    for n in nodes:
        state = n["state"] + (",cordoned" if n.get("cordoned") and n["state"] != "cordoned" else "")
        rows.append([n["node_id"], state, f"{n['gpus_free']}/{n['gpus_total']}", ",".join(n["models"]) or "-"])
    table(["NODE", "STATE", "GPUS FREE/TOTAL", "MODEL"], rows, out)


def job_details(job: dict[str, Any], out: TextIO | None = None) -> None:
    stream = out or sys.stdout
    spec = job.get("spec", {})
    r = spec.get("resources", {})
    lines = [
        ("id", job["id"]),
        ("name", job["name"]),
        ("state", job["state"] + (f" (attempt {job['attempt']})" if job.get("attempt", 0) > 1 else "")
         + (" — cancel requested" if job.get("cancel_requested") and job["state"] not in
            ("cancelled", "succeeded", "failed") else "")),
        ("team/user", f"{job['team']}/{job['user']}"),
        *([("cancelled by", job["cancelled_by"])] if job.get("cancelled_by") else []),
        *([("held by", job["held_by"] + (f": {job['hold_reason']}" if job.get("hold_reason") else ""))]
          if job.get("held_by") else []),
        *([("requeue", f"asked by {job['requeue_requested_by']}; workers being stopped")]
          if job.get("requeue_requested_by") else []),
        *([("resubmitted from", spec["labels"]["resubmitted_from"])]
          if (spec.get("labels") or {}).get("resubmitted_from") else []),
        ("resources", f"{r.get('nodes')} node(s) x {r.get('gpus_per_node')} GPU(s) of {accelerators(r)}"
         + (f", {r['cpus_per_node']} CPUs per node" if r.get("cpus_per_node") else "")),
        ("queue", (spec.get("queue") or "default")
         + (f", class {spec['priority_class']}" if spec.get("priority_class") else "")
         + (f", priority {spec['priority']}" if spec.get("priority") else "")),
        ("command", " ".join(spec.get("command", []))),
        ("created", local_time(job.get("created_at"))),
    ]
    topology = spec.get("topology") or {}
    if topology.get("tier"):
        how = ("required" if topology.get("required") else
               f"waits up to {duration(topology.get('wait_s') or 0)}" if topology.get("wait_s") else "preferred")
        lines.append(("topology", f"within one {topology['tier']} ({how})"))
    if spec.get("time_limit_s"):
        lines.append(("limit", f"{duration(spec['time_limit_s'])} per attempt"))
    if spec.get("max_restarts"):
        lines.append(("restarts", f"{job.get('restarts', 0)} of {spec['max_restarts']}"))
    if job.get("infra_restarts"):
        lines.append(("infra restarts", f"{job['infra_restarts']} (lost nodes / unhealthy GPUs; not counted "
                                        "against max_restarts)"))
    if job.get("preempted_by"):
        lines.append(("preempted", "by " + ", ".join(job["preempted_by"])))
    if job.get("started_at"):
        lines.append(("started", local_time(job["started_at"])))
    if job.get("finished_at"):
        lines.append(("finished", local_time(job["finished_at"])))
    if job.get("exit_code") is not None:
        lines.append(("exit code", str(job["exit_code"])))
    if job.get("message"):
        lines.append(("message", job["message"]))
    width = max(len(k) for k, _ in lines) + 1
    for key, value in lines:
        print(f"{key + ':':<{width}} {value}", file=stream)
    if job.get("placement"):
        print("placement:", file=stream)
        for a in job["placement"]:
            print(f"  {a['node_id']}  node_rank {a['node_rank']}  gpus {','.join(map(str, a['gpu_indices'])) or '-'}"
                  f"  ranks {','.join(map(str, a['ranks']))}" + (f"  {a['model']}" if a.get("model") else ""),
                  file=stream)
    failed = [e for e in job.get("exits", []) if e.get("exit_code") or e.get("signal")]
    if failed:
        print("failed workers:", file=stream)
        for e in failed:
            how = f"signal {e['signal']}" if e.get("signal") else f"exit code {e['exit_code']}"
            print(f"  rank {e['rank']} on {e['node_id']}: {how}", file=stream)
    if job.get("events"):
        print("events:", file=stream)
        for e in job["events"]:
            print(f"  {local_time(e.get('at'))}  {e['kind']}: {e['message']}", file=stream)


def queues_table(queues: Sequence[dict[str, Any]], out: TextIO | None = None) -> None:
    rows = [[q["name"], str(q["tier"]), str(q["max_gpus"]) if q.get("max_gpus") else "-",
             ",".join(f"{k}={v}" for k, v in sorted(q.get("node_labels", {}).items())) or "-",
             q.get("description", "")] for q in queues]
    table(["QUEUE", "TIER", "MAX GPUS", "NODE LABELS", "DESCRIPTION"], rows, out)


def quotas_table(quotas: Sequence[dict[str, Any]], out: TextIO | None = None) -> None:
    rows = []
    for q in quotas:
        limits = sorted(q.get("limits", {}).items(), key=lambda kv: (kv[0] == "*", kv[0]))
        if not limits:
            rows.append([q["team"], f"{q['weight']:g}", "-", "-", "-"])
        for model, limit in limits:
            borrow = limit.get("borrow_limit")
            rows.append([q["team"], f"{q['weight']:g}", "* (any)" if model == "*" else model, str(limit["nominal"]),
                         "unlimited" if borrow is None else str(borrow)])
    table(["TEAM", "WEIGHT", "MODEL", "NOMINAL", "BORROW LIMIT"], rows, out)
