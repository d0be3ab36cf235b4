"""Human output: aligned tables, ages, job details, followed log lines; and the choice of format
(`--output table|wide|json|yaml`, `--json` being `--output json`): `table` the default, `wide` the same with more
columns, `json` and `yaml` the gateway's answer as it is (machine output)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, TextIO

import yaml

FORMATS = ("table", "wide", "json", "yaml")


def print_json(value: Any, out: TextIO | None = None) -> None:
    print(json.dumps(value, indent=2, sort_keys=False), file=out or sys.stdout)


def add_output_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", choices=FORMATS, default=argparse.SUPPRESS,
                        help="table (default), wide (more columns), json or yaml (the gateway's answer)")


def format_of(args: argparse.Namespace) -> str:
    """The output format asked for: --output, else json with --json, else table."""
    chosen = getattr(args, "output", None)
    if chosen:
        return str(chosen)
    return "json" if getattr(args, "json", False) else "table"


def machine(args: argparse.Namespace) -> bool:
    return format_of(args) in ("json", "yaml")


def print_yaml(value: Any, out: TextIO | None = None) -> None:
    (out or sys.stdout).write(yaml.safe_dump(value, sort_keys=False, allow_unicode=True, default_flow_style=False))


def emit(args: argparse.Namespace, value: Any, human: Callable[[bool], None]) -> None:
    """Print `value` (the gateway's answer) as JSON or YAML, or call `human(wide)` for a table."""
    kind = format_of(args)
    if kind == "json":
        print_json(value)
    elif kind == "yaml":
        print_yaml(value)
    else:
        human(kind == "wide")


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


def jobs_table(jobs: Sequence[dict[str, Any]], out: TextIO | None = None, *, wide: bool = False) -> None:
    headers = ["ID", "NAME", "STATE", "GPUS", "TEAM/USER", "AGE"]
    rows = [[j["id"], j["name"], j["state"], gpus(j), f"{j['team']}/{j['user']}", age(j.get("created_at"))]
            for j in jobs]
    if wide:
        headers += ["QUEUE", "PRIORITY", "ATTEMPT", "NODES", "MESSAGE"]
        for row, j in zip(rows, jobs, strict=True):
            spec = j.get("spec", {})
            row += [spec.get("queue") or "default", str(spec.get("priority", 0)), str(j.get("attempt", 0)),
                    ",".join(a["node_id"] for a in j.get("placement", [])) or "-", j.get("message") or "-"]
    table(headers, rows, out)


def _node_state(n: dict[str, Any]) -> str:
    return str(n["state"]) + (",cordoned" if n.get("cordoned") and n["state"] != "cordoned" else "")


def nodes_table(nodes: Sequence[dict[str, Any]], out: TextIO | None = None, *, wide: bool = False) -> None:
    headers = ["NODE", "STATE", "GPUS FREE/TOTAL", "MODEL"]
    rows = [[n["node_id"], _node_state(n), f"{n['gpus_free']}/{n['gpus_total']}", ",".join(n["models"]) or "-"]
            for n in nodes]
    if wide:
        headers += ["UNHEALTHY GPUS", "CPUS", "MEMORY GB", "HOST", "LABELS", "HEARTBEAT", "CORDON REASON"]
        for row, n in zip(rows, nodes, strict=True):
            sick = [str(g["index"]) for g in n.get("gpus", []) if g.get("health") != "healthy"]
            row += [",".join(sick) or "-", str(n.get("cpus", 0)), f"{n.get('memory_mb', 0) / 1024:.0f}",
                    n.get("hostname") or "-",
                    ",".join(f"{k}={v}" for k, v in sorted((n.get("labels") or {}).items())) or "-",
                    age(n.get("last_heartbeat")), n.get("cordon_reason") or "-"]
    table(headers, rows, out)


def node_details(n: dict[str, Any], out: TextIO | None = None) -> None:
    stream = out or sys.stdout
    lines = [("node", n["node_id"]), ("state", _node_state(n)), ("host", n.get("hostname") or "-"),
             ("agent", n.get("agent_address") or "-"), ("gpus free", f"{n['gpus_free']} of {n['gpus_total']}"),
             ("cpus", str(n.get("cpus", 0))), ("memory", f"{n.get('memory_mb', 0)} MB"),
             ("driver", n.get("driver_version") or "-"),
             ("labels", ", ".join(f"{k}={v}" for k, v in sorted((n.get("labels") or {}).items())) or "-"),
             ("registered", local_time(n.get("registered_at"))),
             ("heartbeat", f"{age(n.get('last_heartbeat'))} ago" if n.get("last_heartbeat") else "-")]
    if n.get("cordon_reason"):
        lines.append(("cordoned", n["cordon_reason"]))
    if n.get("simulated"):
        lines.append(("simulated", "yes"))
    width = max(len(k) for k, _ in lines) + 1
    for key, value in lines:
        print(f"{key + ':':<{width}} {value}", file=stream)
    if n.get("gpus"):
        print("gpus:", file=stream)
        table(["  INDEX", "MODEL", "MEMORY MB", "HEALTH", "ALLOCATED", "REASON"],
              [[f"  {g['index']}", g["model"], str(g["memory_mb"]), g["health"], "yes" if g["allocated"] else "no",
                g.get("health_reason") or "-"] for g in n["gpus"]], stream)


def log_line(line: dict[str, Any]) -> str:
    """A followed line (the data of an `event: line`) as the plain logs print it: `[rank N] text`."""
    return f"[rank {line.get('rank')}] {line.get('text', '')}"


def progress(job: dict[str, Any], now: datetime | None = None) -> str:
    """`pending for 2m: no node has 8 free GPUs of A100-SXM4-40GB`: where a job waiting to run stands, from its
    fields (state, how long since it was queued, who holds it, the scheduler's reason, a restart's delay). Pure
    given `now`."""
    since = job.get("queued_at") or job.get("created_at")
    line = str(job["state"]) + (f" for {age(since, now)}" if since else "")
    if job.get("held_by"):
        line += f", held by {job['held_by']}" + (f" ({job['hold_reason']})" if job.get("hold_reason") else "")
    if job.get("not_before"):
        line += f", not placed again before {local_time(job['not_before'])}"
    return line + (f": {job['message']}" if job.get("message") else "")


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def queue_place(entry: dict[str, Any]) -> str:
    """`3rd of 12 in queue default`: a pending job's place (GET /v1/pending); "" for a held one (no place)."""
    if not entry.get("position"):
        return ""
    return f"{ordinal(int(entry['position']))} of {entry['queue_length']} in queue {entry['queue']}"


def end_note(end: dict[str, Any]) -> str:
    """`succeeded`, `failed (exit code 3): message`: how a followed job ended (the data of `event: end`)."""
    code = end.get("exit_code")
    note = str(end.get("state", "ended")) + (f" (exit code {code})" if code not in (None, 0) else "")
    return note + (f": {end['message']}" if end.get("message") else "")


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
    """One row per quota key: its limits and what the team holds under it now (`use`); a key the team holds
    GPUs under without a limit of its own (a model no entry covers) shows "-" for the limits."""
    rows = []
    for q in quotas:
        limits, use = q.get("limits", {}), q.get("use", {})
        keys = sorted({*limits, *use}, key=lambda key: (key == "*", key))
        if not keys:
            rows.append([q["team"], f"{q['weight']:g}", "-", "-", "-", "0", "0"])
        for key in keys:
            limit, held = limits.get(key), use.get(key, {})
            borrow = limit.get("borrow_limit") if limit else None
            rows.append([q["team"], f"{q['weight']:g}", "* (any)" if key == "*" else key,
                         str(limit["nominal"]) if limit else "-",
                         "-" if not limit else "unlimited" if borrow is None else str(borrow),
                         str(held.get("in_use", 0)), str(held.get("borrowed", 0))])
    table(["TEAM", "WEIGHT", "MODEL", "NOMINAL", "BORROW LIMIT", "IN USE", "BORROWED"], rows, out)
