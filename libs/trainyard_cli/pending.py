"""`trainyard pending`: the pending jobs in queue order, with each one's place in its queue and why it waits
(GET /v1/pending; Slurm's `squeue --state=PD` with its Reason column). Tokens other than operators' see their
own team's jobs; the places still count every team's jobs ahead."""

from __future__ import annotations

import argparse
from typing import Any

from trainyard_core import contract

from . import output
from .api import dump
from .commands import api_for
from .errors import UsageError

EPILOG = """\
examples:
  trainyard pending                     your team's pending jobs, in the order they would be placed
  trainyard pending --queue gpu         one queue
  trainyard pending --job JOB           where one job stands
  trainyard pending --team nlp          (operators: one team; without it, every team)

PLACE is the job's place in its queue as the scheduler's last cycle ordered it (queue tier, priority class,
priority, then fair share and submission time); held jobs follow, with no place. Places move as other jobs
are placed, submitted or held.
"""


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("pending", parents=[common], help="show the queue: pending jobs in order and why they wait",
                       description="The pending jobs in the order they would be placed, with why each waits.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--queue", help="only this queue")
    p.add_argument("--job", dest="job_id", metavar="JOB", help="only this job")
    p.add_argument("--team", help="only this team (operators; other tokens see their own team anyway)")
    p.add_argument("--limit", type=int, default=contract.DEFAULT_PENDING_ROWS, metavar="N",
                   help=f"the first N in order (default {contract.DEFAULT_PENDING_ROWS}, at most "
                        f"{contract.MAX_PENDING_ROWS})")
    p.set_defaults(func=cmd_pending)


def cmd_pending(args: argparse.Namespace) -> int:
    if not 1 <= args.limit <= contract.MAX_PENDING_ROWS:
        raise UsageError(f"--limit must be from 1 to {contract.MAX_PENDING_ROWS} (got {args.limit})")
    with api_for(args) as api:
        found = dump(api.list_pending(queue=args.queue or "", job_id=args.job_id or "", team=args.team or "",
                                      limit=args.limit))
    if getattr(args, "json", False):
        output.print_json(found)
        return 0
    print_table(found)
    return 0


def print_table(found: dict[str, Any]) -> None:
    rows = [(e["job_id"], e["queue"], f"{e['position']}/{e['queue_length']}" if e["position"] else "held",
             e["team"], e["user"], output.age(e["queued_at"]), e["reason"]) for e in found["jobs"]]
    output.table(("JOB", "QUEUE", "PLACE", "TEAM", "USER", "WAITING", "REASON"), rows)
    shown, total = len(found["jobs"]), found["total"]
    note = f"{total} pending" + (f", the first {shown} shown" if shown < total else "")
    if found.get("as_of"):
        note += f"; as of {output.local_time(found['as_of'])}"
    print(note)
