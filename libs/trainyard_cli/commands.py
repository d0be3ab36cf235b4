"""The API commands: submit, jobs, status, logs, cancel, queues, quotas, tokens (nodes: nodes.py). Each takes the
parsed arguments and returns the exit code; failures are raised as CliError and printed by main.

Every call goes through `Api` (api.py: the SDK's client, failing with CliErrors); results are the gateway's models,
printed as JSON as the gateway answered them (`dump`) or tabulated from the same dicts.

Following (`logs -f`, `submit --follow`) and watching (`status --watch`) read the gateway's event streams
(the SDK's, which reconnect from the last event id): lines go to stdout as `[rank N] text` as they come;
the gateway's warnings (a node that cannot be read for now) and the CLI's own notes (a restart, a
reconnect) go to stderr."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from trainyard_core import contract
from trainyard_sdk import EndEvent, Job, LineEvent, SdkError, WarningEvent

from . import output
from .api import Api, dump
from .config import resolve
from .errors import CliError, UsageError
from .spec import build_spec, load_spec_file, parse_limits, parse_pairs, parse_speed_hints

TERMINAL = frozenset(state.value for state in contract.JobState if state.terminal)
# `submit --follow`: the exit code of the job's final state (1 and 2 keep their meaning for every command).
EXIT_OF_STATE = {"succeeded": 0, "failed": 3, "cancelled": 4}


def api_for(args: argparse.Namespace) -> Api:
    target = resolve(url_flag=getattr(args, "url", None), token_flag=getattr(args, "token", None),
                     ca_bundle_flag=getattr(args, "ca_bundle", None), environ=os.environ, cwd=Path.cwd())
    return Api(target, timeout=getattr(args, "timeout", None) or 30.0, on_reconnect=_reconnecting)


def _json_wanted(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "json", False))


def cmd_submit(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    spec = build_spec(
        file_spec=load_spec_file(args.file) if args.file else None, name=args.name, command=command,
        nodes=args.nodes, gpus_per_node=args.gpus_per_node, accelerator=args.accelerator,
        env=parse_pairs(args.env, "--env", os.environ), labels=parse_pairs(args.label, "--label"),
        working_dir=args.working_dir, queue=args.queue, priority=args.priority, max_restarts=args.max_restarts,
        overrides=_submit_overrides(args))
    follow = bool(getattr(args, "follow", False))
    if follow and _json_wanted(args):
        raise UsageError("--follow prints the job's logs: it does not mix with --json")
    if getattr(args, "wait", False) and _json_wanted(args):
        raise UsageError("--wait prints the job's progress: it does not mix with --json")
    with api_for(args) as api:
        job = dump(api.submit_job(spec, idempotency_key=args.idempotency_key or None))
        if _json_wanted(args):
            output.print_json(job)
            return 0
        print(f"submitted job {job['id']} ({job['name']}, {output.gpus(job)} GPUs): {job['state']}", flush=True)
        if getattr(args, "wait", False):
            job = wait_started(api, job["id"])
            if job["state"] in TERMINAL and not follow:
                return EXIT_OF_STATE.get(str(job["state"]), 1)
        if not follow:
            return 0
        end = follow_logs(api, job["id"])
    print(f"[trainyard] job {job['id']} {output.end_note(end)}", file=sys.stderr)
    return EXIT_OF_STATE.get(str(end.get("state")), 1)


def _submit_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The submit flags beyond the basic ones, as dotted spec paths (None: not given)."""
    accelerators = None
    if args.accelerators is not None:
        accelerators = [a.strip() for a in args.accelerators.split(",") if a.strip()]
    return {
        "resources.accelerators": accelerators,
        "resources.min_memory_gb": args.min_memory_gb,
        "resources.min_compute_capability": args.min_cc,
        "resources.vendor": args.vendor,
        "resources.allow_mixed": args.allow_mixed,
        "resources.cpus_per_node": args.cpus_per_node,
        "resources.speed_hints": parse_speed_hints(args.speed_hint) if args.speed_hint else None,
        "priority_class": args.priority_class,
        "topology.tier": args.topology_tier,
        "topology.required": args.topology_required,
        "topology.wait_s": args.topology_wait,
        "preemption.signal": args.preempt_signal,
        "preemption.grace_s": args.preempt_grace,
        "restart_backoff_s": args.restart_backoff,
        "time_limit_s": args.time_limit,
        "checkpoint.every_steps": args.checkpoint_every,
        "checkpoint.interval_s": args.checkpoint_interval,
        "checkpoint.keep_last": args.keep_last,
    }


def job_filters(args: argparse.Namespace) -> dict[str, Any]:
    """The filters of `trainyard jobs` (GET /v1/jobs), as `list_jobs_page`'s arguments; only those given."""
    for label in args.label or []:
        if "=" not in label:
            raise UsageError(f"--label expects KEY=VALUE (e.g. project=atlas), got {label!r}")
    named = {"state": args.state, "label": args.label, "user": args.user, "team": args.team, "queue": args.queue,
             "name_prefix": args.name, "submitted_after": args.since, "submitted_before": args.until,
             "finished_after": args.finished_since, "finished_before": args.finished_until}
    return {k: v for k, v in named.items() if v}


def cmd_jobs(args: argparse.Namespace) -> int:
    jobs: list[dict[str, Any]] = []
    token = ""
    filters = job_filters(args)
    with api_for(args) as api:
        while True:
            page = api.list_jobs_page(page_size=args.page_size, page_token=token, **filters)
            jobs.extend(dump(j) for j in page.jobs)
            token = page.next_page_token
            if not token or not args.all:
                break
    if output.machine(args):
        output.emit(args, {"jobs": jobs, "next_page_token": token}, lambda _: None)
        return 0
    if not jobs:
        print("no jobs match" if filters else "no jobs")
        return 0
    output.jobs_table(jobs, wide=output.format_of(args) == "wide")
    if token:
        print(f"(first {len(jobs)} jobs shown; --all lists every one)", file=sys.stderr)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    with api_for(args) as api:
        if not args.watch:
            job = dump(api.get_job(args.job_id))
            output.emit(args, job, lambda _: output.job_details(job))
            return 0
        job = watch_job(api, args.job_id, quiet=output.machine(args))
    output.emit(args, job, lambda _: output.job_details(job))
    return 0 if job["state"] == "succeeded" else 1


def watch_job(api: Api, job_id: str, *, quiet: bool = False) -> dict[str, Any]:
    """Print a line per state change of the job (GET /v1/jobs/{id}/events?watch=true) until it ends; the job
    as it ended."""
    last = ""
    job: Job | None = None
    with api.watch_job(job_id) as changes:
        for change in changes:
            if isinstance(change, Job):
                job = change
                if job.state != last and not quiet:
                    note = f" ({job.message})" if job.message else ""
                    print(f"{time.strftime('%H:%M:%S')}  {job.id}  {job.state}{note}", flush=True)
                last = job.state
    return dump(job if job is not None else api.get_job(job_id))


def wait_started(api: Api, job_id: str) -> dict[str, Any]:
    """Watch the job until it runs or ends, printing where it stands (output.progress) to stderr whenever that
    changes; the job as it was then."""
    shown: tuple[str, ...] = ()
    with api.watch_job(job_id) as changes:
        for change in changes:
            if not isinstance(change, Job):
                continue
            job = dump(change)
            place = _queue_place(api, job_id) if job["state"] == "pending" and not job["held_by"] else ""
            now = (job["state"], job["message"], job["held_by"], str(job["not_before"]), place)
            if now != shown:
                where = f" ({place})" if place else ""
                print(f"[trainyard] job {job_id} {output.progress(job)}{where}", file=sys.stderr, flush=True)
                shown = now
            if job["state"] == "running" or job["state"] in TERMINAL:
                return job
    return dump(api.get_job(job_id))


def _queue_place(api: Api, job_id: str) -> str:
    """Where the pending job stands in its queue (GET /v1/pending), or "" when that cannot be told now (not
    ordered yet, or the scheduler's leader not reachable: the progress line goes on without it)."""
    try:
        found = api.list_pending(job_id=job_id, limit=1)
    except SdkError:
        return ""
    return output.queue_place(dump(found.jobs[0])) if found.jobs else ""


def _reconnecting(reason: str) -> None:
    print(f"[trainyard] {reason}; reconnecting", file=sys.stderr, flush=True)


def log_filters(args: argparse.Namespace) -> dict[str, Any]:
    """`trainyard logs`' selection (GET /v1/jobs/{id}/logs), as `job_logs`' and `follow_logs`' arguments."""
    for rank in args.rank or []:
        if rank < 0:
            raise UsageError(f"--rank expects a rank, 0 or more, got {rank}")
    return {"tail": args.tail, "attempt": args.attempt, "rank": args.rank or None, "since": args.since or None}


def cmd_logs(args: argparse.Namespace) -> int:
    selection = log_filters(args)
    with api_for(args) as api:
        if not args.follow:
            sys.stdout.write(api.job_logs(args.job_id, **selection))
            return 0
        follow_logs(api, args.job_id, **selection)
    return 0


def follow_logs(api: Api, job_id: str, **selection: Any) -> dict[str, Any]:
    """Print the job's lines as they come (GET /v1/jobs/{id}/logs?follow=true) until the stream's end; the
    end's data (the job's state, exit code and message)."""
    newest = 0
    warned: set[str] = set()
    with api.follow_logs(job_id, **selection) as events:
        for event in events:
            if isinstance(event, LineEvent):
                if newest and event.attempt > newest:
                    print(f"[trainyard] job restarted: attempt {event.attempt}", file=sys.stderr, flush=True)
                newest = max(newest, event.attempt)
                print(output.log_line(dump(event)), flush=True)
            elif isinstance(event, WarningEvent):
                if event.message not in warned:
                    warned.add(event.message)
                    print(f"[gateway] {event.message}", file=sys.stderr, flush=True)
            elif isinstance(event, EndEvent):
                return dump(event)
    raise CliError(f"the log stream of job {job_id} ended without its end")


def cmd_cancel(args: argparse.Namespace) -> int:
    with api_for(args) as api:
        job = dump(api.cancel_job(args.job_id, reason=args.reason or ""))
    if _json_wanted(args):
        output.print_json(job)
    elif job["state"] == "cancelled":
        print(f"job {job['id']} cancelled")
    elif job["state"] in TERMINAL:
        print(f"job {job['id']} had already ended: {job['state']}")
    else:
        print(f"cancelling job {job['id']} (state {job['state']}); `trainyard status --watch {job['id']}` "
              "follows it")
    return 0


def cmd_tokens_create(args: argparse.Namespace) -> int:
    with api_for(args) as api:
        created = dump(api.create_token(args.team, args.user, role=args.role, ttl=args.ttl or None,
                                        scopes=sorted(set(args.scope or [])), description=args.description or ""))
    if _json_wanted(args):
        output.print_json(created)
        return 0
    token = created["token"]
    print(f"token id:  {token['token_id']}")
    print(f"team/user: {token['team']}/{token['user']}")
    print(f"role:      {token['role']}" + (f" (scopes {', '.join(token['scopes'])})" if token["scopes"] else ""))
    print(f"expires:   {_expiry(token)}")
    print(f"secret:    {created['secret']}")
    print("The secret is shown only now. Use it as TRAINYARD_TOKEN or `Authorization: Bearer <secret>`.",
          file=sys.stderr)
    return 0


def cmd_tokens_list(args: argparse.Namespace) -> int:
    with api_for(args) as api:
        tokens = [dump(t) for t in api.list_tokens(team=args.team or "")]
    if output.machine(args):
        output.emit(args, {"tokens": tokens}, lambda _: None)
        return 0
    rows = [[t["token_id"], t["team"], t["user"], t["role"], ",".join(t["scopes"]) or "-", _expiry(t),
             output.age(t["created_at"]), t["description"]] for t in tokens]
    output.table(["TOKEN ID", "TEAM", "USER", "ROLE", "SCOPES", "EXPIRES", "AGE", "DESCRIPTION"], rows)
    return 0


def _expiry(token: dict[str, Any]) -> str:
    if token.get("expires_at"):
        return output.local_time(token["expires_at"])
    return "never (legacy)" if token.get("legacy") else "never"


def cmd_tokens_revoke(args: argparse.Namespace) -> int:
    with api_for(args) as api:
        token = dump(api.revoke_token(args.token_id))
    if _json_wanted(args):
        output.print_json(token)
    else:
        print(f"revoked token {token['token_id']} ({token['team']}/{token['user']})")
    return 0


def cmd_queues_list(args: argparse.Namespace) -> int:
    with api_for(args) as api:
        queues = [dump(q) for q in api.list_queues()]
    output.emit(args, {"queues": queues}, lambda _: output.queues_table(queues))
    return 0


def cmd_queues_set(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"tier": args.tier, "max_gpus": args.max_gpus,
                            "node_labels": parse_pairs(args.node_label, "--node-label"),
                            "description": args.description or ""}
    with api_for(args) as api:
        queue = dump(api.put_queue(args.name, body))
    if _json_wanted(args):
        output.print_json(queue)
    else:
        output.queues_table([queue])
    return 0


def cmd_queues_delete(args: argparse.Namespace) -> int:
    with api_for(args) as api:
        queue = dump(api.delete_queue(args.name))
    if _json_wanted(args):
        output.print_json(queue)
    else:
        print(f"deleted queue {queue['name']}")
    return 0


def cmd_quotas_list(args: argparse.Namespace) -> int:
    with api_for(args) as api:
        quotas = [dump(q) for q in api.list_quotas()]
    if not quotas and not output.machine(args):
        print("no quotas (a team without one runs only on borrowed, reclaimable capacity)")
    else:
        output.emit(args, {"quotas": quotas}, lambda _: output.quotas_table(quotas))
    return 0


def cmd_quotas_get(args: argparse.Namespace) -> int:
    with api_for(args) as api:
        quota = dump(api.get_quota(args.team))
    output.emit(args, quota, lambda _: output.quotas_table([quota]))
    return 0


def cmd_quotas_set(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"limits": parse_limits(args.limit)}
    if args.weight is not None:
        body["weight"] = args.weight
    with api_for(args) as api:
        quota = dump(api.put_quota(args.team, body))
    if _json_wanted(args):
        output.print_json(quota)
    else:
        output.quotas_table([quota])
    return 0


def cmd_quotas_delete(args: argparse.Namespace) -> int:
    with api_for(args) as api:
        quota = dump(api.delete_quota(args.team))
    if _json_wanted(args):
        output.print_json(quota)
    else:
        print(f"deleted the quota of team {quota['team']}")
    return 0
