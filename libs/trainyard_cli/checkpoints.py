"""`trainyard checkpoints JOB`: a job's checkpoints (every page, oldest first), one with its lineage, its
manifest (the files, for download tools: `--manifest ID --json`), and tagging, untagging and deleting one
(the job's submitter, a team admin or an operator)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from trainyard_core import contract

from . import output
from .api import dump
from .commands import api_for

EPILOG = """\
examples:
  trainyard checkpoints job-01m8rd01bvcpnb6077                       every checkpoint of the job
  trainyard checkpoints job-01m8rd01bvcpnb6077 --show ckpt-01m8rd3k0ajq1x2b3c
  trainyard checkpoints job-01m8rd01bvcpnb6077 --tag ckpt-01m8rd3k0ajq1x2b3c best
  trainyard checkpoints job-01m8rd01bvcpnb6077 --untag ckpt-01m8rd3k0ajq1x2b3c best
  trainyard checkpoints job-01m8rd01bvcpnb6077 --delete ckpt-01m8rd3k0ajq1x2b3c
  trainyard checkpoints job-01m8rd01bvcpnb6077 --manifest ckpt-01m8rd3k0ajq1x2b3c --json

A tag keeps a committed checkpoint from retention and garbage collection. The job's latest checkpoint (what
a restarting job resumes from, `latest` in STATE) and tagged ones cannot be deleted.
"""


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("checkpoints", parents=[common], help="list a job's checkpoints; tag, untag, delete one",
                       description="List a job's checkpoints, oldest first (the default action), show one with its "
                                   "lineage or its files, or tag, untag or delete one.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("job_id", metavar="JOB")
    action = p.add_mutually_exclusive_group()
    action.add_argument("--show", metavar="ID", help="one checkpoint, with its lineage")
    action.add_argument("--manifest", metavar="ID",
                        help="the files of a committed checkpoint (with --json: for download tools)")
    action.add_argument("--tag", nargs=2, metavar=("ID", "NAME"),
                        help=f"tag a checkpoint; NAME: {contract.CHECKPOINT_TAG.rule}")
    action.add_argument("--untag", nargs=2, metavar=("ID", "NAME"), help="remove a tag")
    action.add_argument("--delete", metavar="ID", help="delete a checkpoint and its files")
    p.add_argument("--page-size", type=int, default=contract.MAX_PAGE_SIZE,
                   help=f"checkpoints per request while listing, 1-{contract.MAX_PAGE_SIZE} (default "
                        f"{contract.MAX_PAGE_SIZE}); every page is listed")
    p.set_defaults(func=cmd_checkpoints)


def size(value: int) -> str:
    """1536 → '1.5 KiB'; below 1 KiB in bytes."""
    if value < 1024:
        return f"{value} B"
    amount, units = value / 1024, ["KiB", "MiB", "GiB", "TiB"]
    while amount >= 1024 and len(units) > 1:
        amount, units = amount / 1024, units[1:]
    return f"{amount:.1f} {units[0]}"


def state(ckpt: dict[str, Any]) -> str:
    return str(ckpt["state"]) + (",latest" if ckpt.get("latest") else "")


def table(checkpoints: list[dict[str, Any]]) -> None:
    output.table(["ID", "STEP", "STATE", "SIZE", "TAGS", "CREATED"],
                 [[ck["id"], str(ck["step"]), state(ck), size(ck["size_bytes"]), ",".join(ck["tags"]) or "-",
                   output.local_time(ck.get("created_at"))] for ck in checkpoints])


def details(ck: dict[str, Any]) -> None:
    lineage = ck.get("lineage") or {}
    lines = [("id", ck["id"]), ("job", f"{ck['job_id']} (team {ck['team']})"), ("state", state(ck)),
             ("step", str(ck["step"])), ("attempt", str(ck["attempt"])), ("world size", str(ck["world_size"])),
             ("size", f"{size(ck['size_bytes'])} in {ck['shard_count']} file(s)"),
             ("tags", ", ".join(ck["tags"]) or "-"),
             ("code version", lineage.get("code_version") or "-"),
             ("parameters", ", ".join(f"{k}={v}" for k, v in sorted((lineage.get("parameters") or {}).items()))
              or "-"),
             ("location", ck["location"]),
             ("created", output.local_time(ck.get("created_at")))]
    for key, label in (("committed_at", "committed"), ("aborted_at", "aborted"), ("damaged_at", "damaged"),
                       ("deleted_at", "deleted")):
        if ck.get(key):
            lines.append((label, output.local_time(ck[key])))
    if ck.get("abort_reason"):
        lines.append(("abort reason", ck["abort_reason"]))
    if ck.get("damage"):
        lines.append(("damage", ck["damage"]))
    if ck.get("metadata"):
        lines.append(("metadata", ", ".join(f"{k}={v}" for k, v in sorted(ck["metadata"].items()))))
    if lineage.get("job_spec") is not None:
        lines.append(("job spec", json.dumps(lineage["job_spec"], sort_keys=True)))
    width = max(len(k) for k, _ in lines) + 1
    for key, value in lines:
        print(f"{key + ':':<{width}} {value}")


def manifest(m: dict[str, Any]) -> None:
    print(f"checkpoint {m['checkpoint_id']} of job {m['job_id']}, step {m['step']}, {m['state']}: "
          f"{size(m['size_bytes'])} in {len(m['shards'])} file(s)")
    print(f"location: {m['location']} (manifest {m['manifest_file']})")
    output.table(["RANK", "SIZE", "CHECKSUM", "PATH"],
                 [[str(s["rank"]), str(s["size_bytes"]), s["checksum"], s["path"]] for s in m["shards"]])


def cmd_checkpoints(args: argparse.Namespace) -> int:
    job = args.job_id
    json_out = bool(getattr(args, "json", False))
    with api_for(args) as api:
        if args.show or args.manifest:
            answer = dump(api.get_checkpoint(job, args.show) if args.show else
                          api.checkpoint_manifest(job, args.manifest))
            if json_out:
                output.print_json(answer)
            else:
                (details if args.show else manifest)(answer)
            return 0
        if args.tag or args.untag or args.delete:
            if args.tag:
                changed, said = api.tag_checkpoint(job, *args.tag), f"tagged {args.tag[0]} {args.tag[1]}"
            elif args.untag:
                changed, said = api.untag_checkpoint(job, *args.untag), f"untagged {args.untag[0]} {args.untag[1]}"
            else:
                changed, said = api.delete_checkpoint(job, args.delete), f"deleted {args.delete}"
            answer = dump(changed)
            if json_out:
                output.print_json(answer)
            else:
                print(f"{said} (step {answer['step']}, {state(answer)}, tags: {', '.join(answer['tags']) or '-'})")
            return 0
        checkpoints = [dump(ck) for ck in api.list_checkpoints(job, page_size=args.page_size)]
    if json_out:
        output.print_json({"checkpoints": checkpoints})
    elif not checkpoints:
        print(f"job {job} has no checkpoints")
    else:
        table(checkpoints)
    return 0
