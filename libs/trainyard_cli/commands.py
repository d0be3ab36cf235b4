"""The API commands: submit, jobs, status, logs, cancel, nodes, queues, quotas, tokens. Each takes the parsed
arguments and returns the exit code; failures are raised as CliError and printed by main."""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from trainyard_core import contract

from . import output
from .api import Api
from .config import resolve
from .errors import UsageError
from .spec import build_spec, load_spec_file, parse_limits, parse_pairs, parse_speed_hints

TERMINAL = frozenset(state.value for state in contract.JobState if state.terminal)
_RANK_PREFIX = re.compile(r"^\[rank (\d+)\] ")


def api_for(args: argparse.Namespace) -> Api:
    target = resolve(url_flag=getattr(args, "url", None), token_flag=getattr(args, "token", None),
                     environ=os.environ, cwd=Path.cwd())
    return Api(target, timeout=getattr(args, "timeout", None) or 30.0)


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
    with api_for(args) as api:
        job = api.submit(spec, idempotency_key=args.idempotency_key or "")
    if _json_wanted(args):
        output.print_json(job)
    else:
        print(f"submitted job {job['id']} ({job['name']}, {output.gpus(job)} GPUs): {job['state']}")
    return 0


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


def job_filters(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The query parameters of `trainyard jobs`' filters (GET /v1/jobs)."""
    for label in args.label or []:
        if "=" not in label:
            raise UsageError(f"--label expects KEY=VALUE (e.g. project=atlas), got {label!r}")
    named = (("user", args.user), ("team", args.team), ("queue", args.queue), ("name_prefix", args.name),
             ("submitted_after", args.since), ("submitted_before", args.until),
             ("finished_after", args.finished_since), ("finished_before", args.finished_until))
    return ([("state", s) for s in args.state or []] + [("label", v) for v in args.label or []]
            + [(k, v) for k, v in named if v])


def cmd_jobs(args: argparse.Namespace) -> int:
    jobs: list[dict[str, Any]] = []
    token = ""
    filters = job_filters(args)
    with api_for(args) as api:
        while True:
            page = api.jobs_page(page_size=args.page_size, page_token=token, filters=filters)
            jobs.extend(page["jobs"])
            token = page.get("next_page_token", "")
            if not token or not args.all:
                break
    if _json_wanted(args):
        output.print_json({"jobs": jobs, "next_page_token": token})
        return 0
    if not jobs:
        print("no jobs match" if filters else "no jobs")
        return 0
    output.jobs_table(jobs)
    if token:
        print(f"(first {len(jobs)} jobs shown; --all lists every one)", file=sys.stderr)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    with api_for(args) as api:
        job = api.job(args.job_id)
        if not args.watch:
            if _json_wanted(args):
                output.print_json(job)
            else:
                output.job_details(job)
            return 0
        last = ""
        while True:
            if job["state"] != last and not _json_wanted(args):
                note = f" ({job['message']})" if job.get("message") else ""
                print(f"{time.strftime('%H:%M:%S')}  {job['id']}  {job['state']}{note}", flush=True)
            last = job["state"]
            if last in TERMINAL:
                break
            time.sleep(args.interval)
            job = api.job(args.job_id)
    if _json_wanted(args):
        output.print_json(job)
    else:
        output.job_details(job)
    return 0 if job["state"] == "succeeded" else 1


def _by_rank(text: str) -> tuple[dict[int, list[str]], list[str]]:
    ranks: dict[int, list[str]] = {}
    notes: list[str] = []
    for line in text.splitlines():
        match = _RANK_PREFIX.match(line)
        if match:
            ranks.setdefault(int(match.group(1)), []).append(line)
        elif line:
            notes.append(line)
    return ranks, notes


def cmd_logs(args: argparse.Namespace) -> int:
    with api_for(args) as api:
        if not args.follow:
            sys.stdout.write(api.logs(args.job_id, tail=args.tail, attempt=args.attempt))
            return 0
        # Follow by polling: the API answers every retained line ordered by rank, so new lines are those
        # past the count already printed for each rank.
        printed: dict[int, int] = {}
        seen_notes: set[str] = set()
        first = True
        attempt = None
        while True:
            job = api.job(args.job_id)
            state = job["state"]
            if args.attempt is None and attempt is not None and job["attempt"] != attempt:
                # A restart: the new attempt's lines start from zero for every rank.
                print(f"[trainyard] job restarted: attempt {job['attempt']}", file=sys.stderr)
                printed.clear()
            attempt = job["attempt"]
            ranks, notes = _by_rank(api.logs(args.job_id, attempt=args.attempt))
            for rank in sorted(ranks):
                lines = ranks[rank]
                start = printed.get(rank, 0)
                if first and args.tail:
                    start = max(0, len(lines) - args.tail)
                for line in lines[start:]:
                    print(line)
                printed[rank] = len(lines)
            for note in notes:
                if note not in seen_notes:
                    seen_notes.add(note)
                    print(note, file=sys.stderr)
            sys.stdout.flush()
            first = False
            if state in TERMINAL:
                return 0
            time.sleep(args.interval)


def cmd_cancel(args: argparse.Namespace) -> int:
    with api_for(args) as api:
        job = api.cancel(args.job_id, args.reason or "")
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


def cmd_nodes(args: argparse.Namespace) -> int:
    with api_for(args) as api:
        nodes = api.nodes()
    if _json_wanted(args):
        output.print_json({"nodes": nodes})
    elif not nodes:
        print("no nodes registered")
    else:
        output.nodes_table(nodes)
    return 0


def cmd_tokens_create(args: argparse.Namespace) -> int:
    with api_for(args) as api:
        created = api.create_token(team=args.team, user=args.user, role=args.role, ttl=args.ttl,
                                   scopes=sorted(set(args.scope or [])), description=args.description or "")
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
        tokens = api.tokens(args.team or "")
    if _json_wanted(args):
        output.print_json({"tokens": tokens})
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
        token = api.revoke_token(args.token_id)
    if _json_wanted(args):
        output.print_json(token)
    else:
        print(f"revoked token {token['token_id']} ({token['team']}/{token['user']})")
    return 0


def cmd_queues_list(args: argparse.Namespace) -> int:
    with api_for(args) as api:
        queues = api.queues()
    if _json_wanted(args):
        output.print_json({"queues": queues})
    else:
        output.queues_table(queues)
    return 0


def cmd_queues_set(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"tier": args.tier, "max_gpus": args.max_gpus,
                            "node_labels": parse_pairs(args.node_label, "--node-label"),
                            "description": args.description or ""}
    with api_for(args) as api:
        queue = api.put_queue(args.name, body)
    if _json_wanted(args):
        output.print_json(queue)
    else:
        output.queues_table([queue])
    return 0


def cmd_queues_delete(args: argparse.Namespace) -> int:
    with api_for(args) as api:
        queue = api.delete_queue(args.name)
    if _json_wanted(args):
        output.print_json(queue)
    else:
        print(f"deleted queue {queue['name']}")
    return 0


def cmd_quotas_list(args: argparse.Namespace) -> int:
    with api_for(args) as api:
        quotas = api.quotas()
    if _json_wanted(args):
        output.print_json({"quotas": quotas})
    elif not quotas:
        print("no quotas (a team without one runs only on borrowed, reclaimable capacity)")
    else:
        output.quotas_table(quotas)
    return 0


def cmd_quotas_get(args: argparse.Namespace) -> int:
    with api_for(args) as api:
        quota = api.quota(args.team)
    if _json_wanted(args):
        output.print_json(quota)
    else:
        output.quotas_table([quota])
    return 0


def cmd_quotas_set(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"limits": parse_limits(args.limit)}
    if args.weight is not None:
        body["weight"] = args.weight
    with api_for(args) as api:
        quota = api.put_quota(args.team, body)
    if _json_wanted(args):
        output.print_json(quota)
    else:
        output.quotas_table([quota])
    return 0


def cmd_quotas_delete(args: argparse.Namespace) -> int:
    with api_for(args) as api:
        quota = api.delete_quota(args.team)
    if _json_wanted(args):
        output.print_json(quota)
    else:
        print(f"deleted the quota of team {quota['team']}")
    return 0
