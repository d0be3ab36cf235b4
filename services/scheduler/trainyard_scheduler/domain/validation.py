"""Validation of job specs from any caller. Every message names the field and what would be valid."""

from __future__ import annotations

import re
from collections.abc import Iterable

from trainyard_core.errors import InvalidArgument

from .models import JobSpec, Node

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
LABEL_KEY_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,62}[A-Za-z0-9])?$")
TEAM_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")

# Set by the scheduler and the agent for every worker; a job may not override them.
RESERVED_ENV = frozenset({
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
    "GROUP_RANK", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
})
RESERVED_ENV_PREFIX = "TRAINYARD_"

MAX_NODES = 4096
MAX_GPUS_PER_NODE = 64
MAX_COMMAND_ARGS = 1024
MAX_COMMAND_BYTES = 128 * 1024
MAX_ENV_VARS = 256
MAX_ENV_VALUE_BYTES = 32 * 1024
MAX_LABELS = 64
PRIORITY_RANGE = (-1000, 1000)
MAX_RESTARTS = 100


def validate_spec(spec: JobSpec) -> None:
    problems = list(_problems(spec))
    if problems:
        raise InvalidArgument("invalid job spec: " + "; ".join(problems))


def _problems(spec: JobSpec) -> Iterable[str]:
    if not NAME_RE.match(spec.name):
        yield (f"name {spec.name!r} must be 1-63 characters of letters, digits, '.', '_' or '-', "
               "starting with a letter or digit")
    if not spec.command:
        yield "command must not be empty (e.g. [\"python\", \"train.py\"])"
    elif not spec.command[0].strip():
        yield "command[0] (the program) must not be empty"
    if len(spec.command) > MAX_COMMAND_ARGS:
        yield f"command has {len(spec.command)} arguments; at most {MAX_COMMAND_ARGS} are allowed"
    if sum(len(a.encode()) for a in spec.command) > MAX_COMMAND_BYTES:
        yield f"command is longer than {MAX_COMMAND_BYTES} bytes"
    if any("\0" in a for a in spec.command):
        yield "command arguments must not contain NUL characters"
    r = spec.resources
    if not 1 <= r.nodes <= MAX_NODES:
        yield f"resources.nodes must be between 1 and {MAX_NODES}, got {r.nodes}"
    if not 1 <= r.gpus_per_node <= MAX_GPUS_PER_NODE:
        yield f"resources.gpus_per_node must be between 1 and {MAX_GPUS_PER_NODE}, got {r.gpus_per_node}"
    if len(r.accelerator) > 64:
        yield "resources.accelerator must be at most 64 characters"
    if len(spec.env) > MAX_ENV_VARS:
        yield f"env has {len(spec.env)} variables; at most {MAX_ENV_VARS} are allowed"
    for key, value in spec.env.items():
        if not ENV_KEY_RE.match(key):
            yield f"env key {key!r} is not a valid variable name ([A-Za-z_][A-Za-z0-9_]*)"
        elif key in RESERVED_ENV or key.startswith(RESERVED_ENV_PREFIX):
            yield f"env key {key!r} is set by Trainyard for every worker and cannot be overridden"
        if len(value.encode()) > MAX_ENV_VALUE_BYTES or "\0" in value:
            yield f"env value of {key!r} must be under {MAX_ENV_VALUE_BYTES} bytes without NUL characters"
    if spec.working_dir and (not spec.working_dir.startswith("/") or "\0" in spec.working_dir):
        yield f"working_dir {spec.working_dir!r} must be an absolute path"
    if not NAME_RE.match(spec.queue):
        yield f"queue {spec.queue!r} must be 1-63 characters of letters, digits, '.', '_' or '-'"
    lo, hi = PRIORITY_RANGE
    if not lo <= spec.priority <= hi:
        yield f"priority must be between {lo} and {hi}, got {spec.priority}"
    if not 0 <= spec.max_restarts <= MAX_RESTARTS:
        yield f"max_restarts must be between 0 and {MAX_RESTARTS}, got {spec.max_restarts}"
    if len(spec.labels) > MAX_LABELS:
        yield f"labels: at most {MAX_LABELS} are allowed"
    for key, value in spec.labels.items():
        if not LABEL_KEY_RE.match(key) or len(value) > 253:
            yield f"label {key!r} must be a short name of letters, digits, '.', '_', '/' or '-'"


def validate_team(team: str) -> None:
    if not TEAM_RE.match(team):
        raise InvalidArgument(f"team {team!r} must be 1-63 lower-case letters, digits or '-'")


def check_fits_fleet(spec: JobSpec, nodes: Iterable[Node]) -> None:
    """Refuse a job that no amount of waiting could place on the registered fleet."""
    fleet = list(nodes)
    if not fleet:
        return  # nothing registered yet (a fresh cluster): the job waits for nodes
    r = spec.resources
    matching = [n for n in fleet if not r.accelerator or any(g.model == r.accelerator for g in n.gpus)]
    if r.accelerator and not matching:
        models = sorted({g.model for n in fleet for g in n.gpus})
        raise InvalidArgument(f"resources.accelerator {r.accelerator!r} matches no node; "
                              f"models in the fleet: {', '.join(models) or 'none'}")
    largest = max((sum(1 for g in n.gpus if not r.accelerator or g.model == r.accelerator)
                   for n in matching), default=0)
    if r.gpus_per_node > largest:
        raise InvalidArgument(f"resources.gpus_per_node={r.gpus_per_node} is more than any node has "
                              f"(the largest has {largest} GPUs)")
    big_enough = sum(1 for n in matching if sum(
        1 for g in n.gpus if not r.accelerator or g.model == r.accelerator) >= r.gpus_per_node)
    if r.nodes > big_enough:
        raise InvalidArgument(f"resources.nodes={r.nodes} is more than the {big_enough} node(s) with "
                              f"{r.gpus_per_node} or more GPUs in the fleet")
