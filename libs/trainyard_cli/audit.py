"""`trainyard audit`: the cluster's audit log, newest first (operators). Pages through GET /v1/audit until
--limit entries are shown or the log has no more."""

from __future__ import annotations

import argparse
from typing import Any

from trainyard_core import contract

from . import output
from .api import dump
from .commands import api_for
from .errors import UsageError
from .spec import when

EPILOG = """\
examples:
  trainyard audit                                   the last 50 entries
  trainyard audit --user alice --since 1h
  trainyard audit --action CancelJob --target job/job-01m8rd01bvcpnb6077
  trainyard audit --result permission_denied --limit 200 --output json

--since/--until take a duration back from now (90s, 10m, 1h30m, 2d) or a time (2026-01-31T12:00:00Z).
--action matches a whole action (`POST /v1/jobs/{job_id}:cancel`) or its last part (`CancelJob`).
"""


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("audit", parents=[common], help="show the audit log (operator)",
                       description="Who did what to what, with which result: every mutating call on the "
                                   "gateway, the scheduler and the checkpoint-store, newest first.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--user", help="a gateway user, in any team")
    p.add_argument("--principal", help="exactly this principal: user:<team>/<user>, trainyard://tool/<name>, ...")
    p.add_argument("--team", help="the team acted for")
    p.add_argument("--action", help="an action, or its last part (CancelJob)")
    p.add_argument("--target", help="what was acted on: job/<id>, node/<id>, queue/<name>, team/<team>, token/<id>")
    p.add_argument("--result", help="ok, or an error code (permission_denied, not_found, ...)")
    p.add_argument("--request-id", help="every entry of one request (the X-Request-Id of its answer)")
    p.add_argument("--since", type=when, metavar="WHEN", help="only entries at or after this (1h: an hour ago)")
    p.add_argument("--until", type=when, metavar="WHEN", help="only entries at or before this")
    p.add_argument("--limit", type=int, default=contract.DEFAULT_PAGE_SIZE, metavar="N",
                   help=f"show at most N entries (default {contract.DEFAULT_PAGE_SIZE})")
    p.add_argument("--output", choices=("table", "json"), default="table", help="table (default) or json")
    p.set_defaults(func=cmd_audit)


def cmd_audit(args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise UsageError(f"--limit must be at least 1 (got {args.limit})")
    params: dict[str, Any] = {name: value for name, value in (
        ("user", args.user), ("principal", args.principal), ("team", args.team), ("action", args.action),
        ("target", args.target), ("result", args.result), ("request_id", args.request_id),
        ("since", args.since), ("until", args.until)) if value}
    entries: list[dict[str, Any]] = []
    token = ""
    with api_for(args) as api:
        while len(entries) < args.limit:
            page = api.audit_page(**params, page_size=min(contract.MAX_PAGE_SIZE, args.limit - len(entries)),
                                  page_token=token)
            entries += [dump(e) for e in page.entries]
            token = page.next_page_token
            if not token:
                break
    if args.output == "json" or getattr(args, "json", False):
        output.print_json({"entries": entries})
    elif not entries:
        print("no audit entries match")
    else:
        output.table(["TIME", "PRINCIPAL", "ROLE", "ACTION", "TARGET", "RESULT", "REQUEST ID"],
                     [[output.local_time(e["time"]), e["principal"], e["role"], e["action"], e["target"],
                       e["result"], e["request_id"]] for e in entries])
    return 0
