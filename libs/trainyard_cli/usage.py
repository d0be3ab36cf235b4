"""`trainyard usage`: GPU-hours, CPU-hours and cost over a window, by team, project, user, model, queue or job
(GET /v1/usage). Tokens other than operators' see their own team's use."""

from __future__ import annotations

import argparse
import csv
import sys
from typing import Any

from trainyard_core import contract

from . import output
from .api import dump
from .commands import api_for
from .errors import UsageError
from .output import parse_time
from .spec import when

EPILOG = f"""\
examples:
  trainyard usage                                   the last {contract.DEFAULT_USAGE_WINDOW_DAYS} days, by team
  trainyard usage --since 7d --by project
  trainyard usage --since 2026-01-01T00:00:00Z --until 2026-02-01T00:00:00Z --by user --output csv > jan.csv
  trainyard usage --team vision --by job --limit 20   (operators: one team)

--since/--until take a duration back from now (90s, 10m, 1h30m, 2d) or a time (2026-01-31T12:00:00Z).
Running jobs count up to now; a job that crosses --since or --until counts only with its part inside.
Cost is GPU-hours times the price per GPU-hour of their model (the scheduler's usage_prices); models
without a price are named below the table, their GPU-hours counted at cost 0.
"""


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("usage", parents=[common], help="show GPU-hours, CPU-hours and cost",
                       description="GPU-hours, CPU-hours and cost of the jobs that ran in a window, grouped.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--since", type=when, metavar="WHEN",
                   help=f"the window's start (default: {contract.DEFAULT_USAGE_WINDOW_DAYS}d before its end)")
    p.add_argument("--until", type=when, metavar="WHEN", help="the window's end (default: now)")
    p.add_argument("--by", choices=contract.USAGE_GROUPS, default=contract.DEFAULT_USAGE_GROUP,
                   help=f"what a row is (default {contract.DEFAULT_USAGE_GROUP})")
    p.add_argument("--team", help="only this team (operators; other tokens see their own team anyway)")
    p.add_argument("--limit", type=int, default=contract.DEFAULT_USAGE_ROWS, metavar="N",
                   help=f"the N largest groups (default {contract.DEFAULT_USAGE_ROWS}, at most "
                        f"{contract.MAX_USAGE_ROWS}); the total covers every group")
    p.add_argument("--output", choices=("table", "csv", "json"), default="table",
                   help="table (default), csv (one row per group, full precision) or json (the API's answer)")
    p.set_defaults(func=cmd_usage)


def cmd_usage(args: argparse.Namespace) -> int:
    if not 1 <= args.limit <= contract.MAX_USAGE_ROWS:
        raise UsageError(f"--limit must be from 1 to {contract.MAX_USAGE_ROWS} (got {args.limit})")
    since, until = parse_time(args.since), parse_time(args.until)
    if since is not None and until is not None and since > until:
        raise UsageError(f"--since ({args.since}) is after --until ({args.until}): the window would hold nothing")
    with api_for(args) as api:
        report = dump(api.usage(from_=args.since or None, to=args.until or None, group_by=args.by,
                                team=args.team or "", limit=args.limit))
    if args.output == "json" or getattr(args, "json", False):
        output.print_json(report)
    elif args.output == "csv":
        write_csv(report)
    else:
        print_table(report)
    return 0


def write_csv(report: dict[str, Any]) -> None:
    out = csv.writer(sys.stdout, lineterminator="\n")
    out.writerow([report["group_by"], "gpu_hours", "cpu_hours", "cost", "currency", "unpriced_gpu_hours"])
    for r in report["rows"]:
        out.writerow([r["group"], repr(r["gpu_hours"]), repr(r["cpu_hours"]), repr(r["cost"]), report["currency"],
                      repr(r["unpriced_gpu_hours"])])


def _hours(value: float) -> str:
    return f"{value:,.2f}"


def print_table(report: dict[str, Any]) -> None:
    team = f" of team {report['team']}" if report["team"] else ""
    print(f"usage{team} from {output.local_time(report['from'])} to {output.local_time(report['to'])}, "
          f"by {report['group_by']}")
    if not report["rows"]:
        print("no use in this window")
        return
    currency = report["currency"]
    rows = [[r["group"] or "(none)", _hours(r["gpu_hours"]), _hours(r["cpu_hours"]), f"{r['cost']:,.2f}"]
            for r in report["rows"]]
    total = report["total"]
    rows.append(["TOTAL", _hours(total["gpu_hours"]), _hours(total["cpu_hours"]), f"{total['cost']:,.2f}"])
    output.table([report["group_by"].upper(), "GPU-HOURS", "CPU-HOURS", f"COST ({currency})"], rows)
    if report["groups"] > len(report["rows"]):
        print(f"the {len(report['rows'])} largest of {report['groups']} groups (--limit); TOTAL covers all")
    if report["unpriced_models"]:
        print(f"no price for {', '.join(m or '(unknown model)' for m in report['unpriced_models'])}: "
              f"{_hours(total['unpriced_gpu_hours'])} GPU-hours counted at cost 0 (the scheduler's usage_prices "
              "setting prices a model)")
