"""The job operations: `hold`, `release`, `requeue`, `priority` and `resubmit` (with `--set KEY=VALUE`).

`resubmit --set` takes the spec's own keys as dotted paths (`resources.nodes=4`, `env.LR=1e-4`,
`time_limit_s=2h`), the resources' keys also bare (`nodes=4`), and sends them as a JSON merge patch of the
original job's spec; `--unset KEY` removes one (an env variable, a label) or puts a field back to its default.
The gateway validates the result and its message names any offending field.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import Any

from trainyard_core import contract

from . import output
from .api import dump
from .commands import TERMINAL, api_for
from .errors import UsageError
from .spec import DURATION_FIELDS, _set_path, parse_duration

RESUBMIT_EPILOG = """\
examples:
  trainyard resubmit job-01m8rd01bvcpnb6077 --set nodes=4 --set env.LR=1e-4
  trainyard resubmit job-01m8rd01bvcpnb6077 --set time_limit_s=6h --set priority_class=high --unset env.DEBUG
  trainyard resubmit job-01m8rd01bvcpnb6077 --set 'command=python train.py --epochs 5'

KEY is a spec field as a dotted path: name, command, working_dir, queue, priority, priority_class, max_restarts,
time_limit_s, restart_backoff_s, resources.{nodes,gpus_per_node,accelerator,accelerators,min_memory_gb,
min_compute_capability,vendor,allow_mixed,cpus_per_node}, resources.speed_hints.MODEL, topology.{tier,required,
wait_s}, preemption.{signal,grace_s}, checkpoint.{every_steps,interval_s,keep_last}, env.NAME, labels.NAME.
The resources' keys may be given bare (nodes=4). Durations: seconds, or like 90s, 10m, 1h30m, 2d; lists
(accelerators) comma-separated; booleans true or false.
"""


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("true", "yes", "1", "on"):
        return True
    if value in ("false", "no", "0", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def _duration(text: str) -> float:
    return parse_duration(text)


def _list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _command(text: str) -> list[str]:
    return shlex.split(text)


def _signal(text: str) -> str:
    name = text.strip().upper()
    return name if name.startswith("SIG") else "SIG" + name


_RESOURCES: dict[str, Callable[[str], Any]] = {
    "nodes": int, "gpus_per_node": int, "accelerator": str, "accelerators": _list, "min_memory_gb": int,
    "min_compute_capability": str, "vendor": str, "allow_mixed": _bool, "cpus_per_node": int}
# Settable keys → how a value is read (the submit body's types).
FIELDS: dict[str, Callable[[str], Any]] = {
    "name": str, "command": _command, "working_dir": str, "queue": str, "priority": int, "priority_class": str,
    "max_restarts": int, **{f"resources.{k}": v for k, v in _RESOURCES.items()},
    "topology.tier": str, "topology.required": _bool, "preemption.signal": _signal,
    "checkpoint.every_steps": int, "checkpoint.keep_last": int,
    **{path: _duration for path in DURATION_FIELDS},
}
# Maps whose entries are set one by one: prefix → how a value is read.
MAPS: dict[str, Callable[[str], Any]] = {"env.": str, "labels.": str, "resources.speed_hints.": float}


def _key(raw: str) -> str:
    key = raw.strip().replace("-", "_") if not raw.startswith(tuple(MAPS)) else raw.strip()
    if key in _RESOURCES:
        return f"resources.{key}"
    return key


def _reader(key: str) -> Callable[[str], Any]:
    if key in FIELDS:
        return FIELDS[key]
    for prefix, read in MAPS.items():
        if key.startswith(prefix) and len(key) > len(prefix):
            return read
    known = ", ".join([*FIELDS, *(p + "NAME" for p in MAPS)])
    raise UsageError(f"--set/--unset: unknown key {key!r}; keys are {known}")


def build_overrides(sets: Sequence[str], unsets: Sequence[str] = ()) -> dict[str, Any]:
    """The merge patch of `--set KEY=VALUE` and `--unset KEY` items (later ones win)."""
    patch: dict[str, Any] = {}
    for item in sets:
        raw, sep, text = item.partition("=")
        if not sep or not raw.strip():
            raise UsageError(f"--set expects KEY=VALUE (e.g. resources.nodes=4 or env.LR=1e-4), got {item!r}")
        key = _key(raw)
        try:
            value = _reader(key)(text)
        except ValueError as exc:
            raise UsageError(f"--set {key}: {exc}") from None
        _set_leaf(patch, key, value)
    for raw in unsets:
        key = _key(raw)
        _reader(key)
        _set_leaf(patch, key, None)
    return patch


def _set_leaf(patch: dict[str, Any], key: str, value: Any) -> None:
    # A map key (env.NAME) may itself hold dots: split off only the map's prefix.
    for prefix in MAPS:
        if key.startswith(prefix):
            parent = prefix[:-1]
            _set_path(patch, parent, {**_dig(patch, parent), key[len(prefix):]: value})
            return
    _set_path(patch, key, value)


def _dig(patch: dict[str, Any], path: str) -> dict[str, Any]:
    node: Any = patch
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return dict(node) if isinstance(node, dict) else {}


def _report(args: argparse.Namespace, job: dict[str, Any], text: str) -> int:
    if getattr(args, "json", False):
        output.print_json(job)
    else:
        print(text)
    return 0


def cmd_hold(args: argparse.Namespace) -> int:
    with api_for(args) as api:
        job = dump(api.hold_job(args.job_id, reason=args.reason or ""))
    return _report(args, job, f"job {job['id']} held by {job.get('held_by') or '?'}: not placed until "
                              f"`trainyard release {job['id']}`")


def cmd_release(args: argparse.Namespace) -> int:
    with api_for(args) as api:
        job = dump(api.release_job(args.job_id))
    return _report(args, job, f"job {job['id']} released: {job['state']} ({job.get('message') or 'queued'})")


def cmd_requeue(args: argparse.Namespace) -> int:
    with api_for(args) as api:
        job = dump(api.requeue_job(args.job_id, reason=args.reason or ""))
    if job["state"] == "pending":
        text = f"job {job['id']} requeued: attempt {job['attempt']} is pending"
    else:
        text = (f"requeueing job {job['id']} (state {job['state']}): its workers are being stopped; "
                f"`trainyard status --watch {job['id']}` follows it")
    return _report(args, job, text)


def cmd_priority(args: argparse.Namespace) -> int:
    with api_for(args) as api:
        job = dump(api.set_job_priority(args.job_id, args.priority))
    return _report(args, job, f"job {job['id']} ({job['state']}): priority {job['spec']['priority']}")


def cmd_resubmit(args: argparse.Namespace) -> int:
    overrides = build_overrides(args.set or [], args.unset or [])
    with api_for(args) as api:
        job = dump(api.resubmit_job(args.job_id, overrides, idempotency_key=args.idempotency_key or None))
    empty = sorted(k for k, v in (job.get("spec", {}).get("env") or {}).items() if v == "")
    if empty and not getattr(args, "json", False):
        print(f"note: {', '.join(empty)} {'is' if len(empty) == 1 else 'are'} empty in the new job (a finished job's "
              "environment keeps its names, not their values); pass --set env.NAME=VALUE to give them",
              file=sys.stderr)
    state = job["state"]
    return _report(args, job, f"resubmitted {args.job_id} as job {job['id']} ({job['name']}, {output.gpus(job)} "
                              f"GPUs): {state}" + ("" if state not in TERMINAL else " (already ended)"))


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("hold", parents=[common], help="hold a pending job (not placed until released)",
                       description="Hold a pending job: it keeps its place in the queue but is not placed until "
                                   "`trainyard release`. Only a pending job can be held.")
    p.add_argument("job_id")
    p.add_argument("--reason", help="recorded in the job's events")
    p.set_defaults(func=cmd_hold)

    p = sub.add_parser("release", parents=[common], help="release a held job",
                       description="Release a held job: it is placed again from its original place in the queue. "
                                   "A hold is lifted by whoever placed it or by a team admin.")
    p.add_argument("job_id")
    p.set_defaults(func=cmd_release)

    p = sub.add_parser("requeue", parents=[common], help="stop a running job and queue it again",
                       description="Stop a running job as a preemption would (its preemption signal, then its "
                                   "grace) and queue it again as a new attempt; not counted as a restart.")
    p.add_argument("job_id")
    p.add_argument("--reason", help="recorded in the job's events")
    p.set_defaults(func=cmd_requeue)

    p = sub.add_parser("priority", parents=[common], help="change a job's priority",
                       description="Change the priority of a job that has not finished; the scheduler uses it "
                                   "from its next cycle (placement order and preemption).")
    p.add_argument("job_id")
    p.add_argument("priority", type=int, help=f"{contract.MIN_PRIORITY}..{contract.MAX_PRIORITY}")
    p.set_defaults(func=cmd_priority)

    p = sub.add_parser("resubmit", parents=[common], help="submit a new job from a job's spec, with changes",
                       description="Submit a new job (as you) from the spec of JOB, in any state, also one that "
                                   "has left etcd for the history store, with --set/--unset changes. The new job's "
                                   f"label {contract.RESUBMITTED_FROM_LABEL} names JOB.",
                       epilog=RESUBMIT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("job_id")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="change a spec field (repeatable)")
    p.add_argument("--unset", action="append", default=[], metavar="KEY",
                   help="remove an env variable or label, or put a field back to its default (repeatable)")
    p.add_argument("--idempotency-key", help="a retried resubmit with the same key returns the first job")
    p.set_defaults(func=cmd_resubmit)
