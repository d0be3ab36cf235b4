"""Validation of job specs from any caller. Every message names the field and what would be valid.

Two kinds of refusal, with different codes:
- `validate_spec` / `validate_team`: the request breaks the API's contract (`trainyard_core.contract`, the
  same limits and rules the gateway's OpenAPI schema states), whatever the cluster: InvalidArgument.
- `check_fits_fleet`, `check_queue`, `check_priority_class`: a well-formed request this cluster cannot
  take as it is now (no node that large, a queue nobody created, a class the operator did not define):
  FailedPrecondition. The request is not wrong, the cluster would have to change.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Sequence

from trainyard_core import contract as c
from trainyard_core.errors import FailedPrecondition, InvalidArgument

from .models import Gpu, JobSpec, Node, Resources

# What the policy servicer checks team names with before a record is built.
TEAM_RE = re.compile(c.TEAM.pattern)
RESERVED_ENV = frozenset(c.RESERVED_ENV)


def validate_spec(spec: JobSpec) -> None:
    problems = list(_problems(spec))
    if problems:
        raise InvalidArgument("invalid job spec: " + "; ".join(problems))


def _problems(spec: JobSpec) -> Iterable[str]:
    if not c.JOB_NAME.matches(spec.name):
        yield f"name {spec.name[:80]!r} must be {c.JOB_NAME.rule}"
    yield from _command_problems(spec.command)
    yield from _resource_problems(spec.resources)
    if len(spec.env) > c.MAX_ENV_VARS:
        yield f"env has {len(spec.env)} variables; at most {c.MAX_ENV_VARS} are allowed"
    for key, value in spec.env.items():
        if not c.ENV_KEY.matches(key):
            yield f"env key {key[:80]!r} is not a valid variable name ({c.ENV_KEY.rule})"
        elif key in RESERVED_ENV or key.startswith(c.RESERVED_ENV_PREFIX):
            yield f"env key {key!r} is set by Trainyard for every worker and cannot be overridden"
        if len(value) > c.MAX_ENV_VALUE_LENGTH or not c.NO_NUL.matches(value):
            yield (f"env value of {key[:80]!r} must be at most {c.MAX_ENV_VALUE_LENGTH} characters without NUL "
                   "characters")
    if len(spec.working_dir) > c.MAX_WORKING_DIR_LENGTH or not c.WORKING_DIR.matches(spec.working_dir):
        yield (f"working_dir {spec.working_dir[:80]!r} must be {c.WORKING_DIR.rule}, at most "
               f"{c.MAX_WORKING_DIR_LENGTH} characters")
    if not c.QUEUE_NAME.matches(spec.queue):
        yield f"queue {spec.queue[:80]!r} must be {c.QUEUE_NAME.rule}"
    if not c.MIN_PRIORITY <= spec.priority <= c.MAX_PRIORITY:
        yield f"priority must be between {c.MIN_PRIORITY} and {c.MAX_PRIORITY}, got {spec.priority}"
    if not 0 <= spec.max_restarts <= c.MAX_RESTARTS:
        yield f"max_restarts must be between 0 and {c.MAX_RESTARTS}, got {spec.max_restarts}"
    if len(spec.labels) > c.MAX_LABELS:
        yield f"labels: at most {c.MAX_LABELS} are allowed"
    for key, value in spec.labels.items():
        if not c.LABEL_KEY.matches(key):
            yield f"label key {key[:80]!r} must be {c.LABEL_KEY.rule}"
        if len(value) > c.MAX_LABEL_VALUE_LENGTH:
            yield f"label {key[:80]!r}: values are at most {c.MAX_LABEL_VALUE_LENGTH} characters"
    if spec.priority_class and not c.PRIORITY_CLASS.matches(spec.priority_class):
        yield (f"priority_class {spec.priority_class[:80]!r} must be {c.PRIORITY_CLASS.rule} (or empty for the "
               "default class)")
    yield from _policy_problems(spec)


def _command_problems(command: tuple[str, ...]) -> Iterable[str]:
    if not command:
        yield "command must not be empty (e.g. [\"python\", \"train.py\"])"
        return
    if not c.PROGRAM.matches(command[0]):
        yield f"command[0] (the program) must be {c.PROGRAM.rule}"
    if len(command) > c.MAX_COMMAND_ARGS:
        yield f"command has {len(command)} arguments; at most {c.MAX_COMMAND_ARGS} are allowed"
    if any(len(a) > c.MAX_ARG_LENGTH for a in command):
        yield f"command: each argument is at most {c.MAX_ARG_LENGTH} characters"
    elif sum(len(a) for a in command) > c.MAX_COMMAND_LENGTH:
        yield f"command is longer than {c.MAX_COMMAND_LENGTH} characters (every argument together)"
    if not all(c.NO_NUL.matches(a) for a in command[1:]):
        yield "command arguments must not contain NUL characters"


def _seconds_problem(field: str, value: float, limit: float, zero: str) -> str | None:
    if not math.isfinite(value) or not 0 <= value <= limit:
        return f"{field} must be between 0 ({zero}) and {limit:g} seconds, got {value:g}"
    return None


def _resource_problems(r: Resources) -> Iterable[str]:
    if not 1 <= r.nodes <= c.MAX_NODES:
        yield f"resources.nodes must be between 1 and {c.MAX_NODES}, got {r.nodes}"
    if not 0 <= r.gpus_per_node <= c.MAX_GPUS_PER_NODE:
        yield (f"resources.gpus_per_node must be between 0 (a CPU task, on CPU-only nodes) and "
               f"{c.MAX_GPUS_PER_NODE}, got {r.gpus_per_node}")
    if r.accelerator and not c.MODEL_NAME.matches(r.accelerator):
        yield f"resources.accelerator {r.accelerator[:80]!r} must be {c.MODEL_NAME.rule} (or empty for any)"
    if r.accelerator and r.accelerators:
        yield ("resources: give either accelerator (one exact model) or accelerators (any of several), "
               "not both")
    if len(r.accelerators) > c.MAX_ACCELERATORS:
        yield (f"resources.accelerators lists {len(r.accelerators)} models; at most {c.MAX_ACCELERATORS} are "
               "allowed")
    seen: set[str] = set()
    for name in r.accelerators:
        if not c.MODEL_NAME.matches(name):
            yield f"resources.accelerators: each model name must be {c.MODEL_NAME.rule}, got {name[:80]!r}"
        elif name in seen:
            yield f"resources.accelerators lists {name!r} twice"
        seen.add(name)
    if not 0 <= r.min_memory_gb <= c.MAX_MEMORY_GB:
        yield f"resources.min_memory_gb must be between 0 (any) and {c.MAX_MEMORY_GB}, got {r.min_memory_gb}"
    if r.min_compute_capability and not c.COMPUTE_CAPABILITY.matches(r.min_compute_capability):
        yield (f"resources.min_compute_capability must look like \"8.0\" or \"9.0\" (major.minor), got "
               f"{r.min_compute_capability[:80]!r}")
    if len(r.vendor) > c.MAX_VENDOR_LENGTH:
        yield f"resources.vendor must be at most {c.MAX_VENDOR_LENGTH} characters (e.g. \"nvidia\", \"amd\")"
    if not 0 <= r.cpus_per_node <= c.MAX_CPUS_PER_NODE:
        yield f"resources.cpus_per_node must be between 0 and {c.MAX_CPUS_PER_NODE}, got {r.cpus_per_node}"
    if len(r.speed_hints) > c.MAX_SPEED_HINTS:
        yield f"resources.speed_hints has {len(r.speed_hints)} entries; at most {c.MAX_SPEED_HINTS} are allowed"
    for model, factor in r.speed_hints.items():
        if not c.MODEL_NAME.matches(model):
            yield f"resources.speed_hints: model names must be {c.MODEL_NAME.rule}, got {model[:80]!r}"
        if not math.isfinite(factor) or not 0 < factor <= c.MAX_SPEED_HINT:
            yield (f"resources.speed_hints[{model[:80]!r}] must be > 0 and <= {c.MAX_SPEED_HINT:g} (relative "
                   f"throughput per GPU), got {factor:g}")
    if r.cpu_only:
        asked = [name for name, value in (("accelerator", r.accelerator), ("accelerators", r.accelerators),
                                          ("min_memory_gb", r.min_memory_gb),
                                          ("min_compute_capability", r.min_compute_capability),
                                          ("vendor", r.vendor)) if value]
        if asked:
            yield (f"resources.gpus_per_node=0 is a CPU task, which gets no GPU: remove resources."
                   f"{', resources.'.join(asked)}, or ask for GPUs")


def _policy_problems(spec: JobSpec) -> Iterable[str]:
    t = spec.topology
    if t.tier and t.tier not in c.TOPOLOGY_TIERS:
        yield (f"topology.tier {t.tier[:80]!r} must be one of {', '.join(c.TOPOLOGY_TIERS)} (or empty for no "
               "constraint)")
    if t.required and not t.tier:
        yield "topology.required needs topology.tier (the domain the gang must fit in)"
    problem = _seconds_problem("topology.wait_s", t.wait_s, c.MAX_TOPOLOGY_WAIT_S, "no wait")
    if problem:
        yield problem
    elif t.wait_s and not t.tier:
        yield "topology.wait_s needs topology.tier (the domain to wait for)"
    elif t.wait_s and t.required:
        yield ("topology.wait_s applies only when topology.required is false (required waits without a "
               "limit); set one of them")
    p = spec.preemption
    if p.signal not in c.PREEMPTION_SIGNALS:
        yield f"preemption.signal {p.signal[:80]!r} must be one of {', '.join(c.PREEMPTION_SIGNALS)}"
    for problem_or_none in (
        _seconds_problem("preemption.grace_s", p.grace_s, c.MAX_GRACE_S, "the scheduler's default grace"),
        _seconds_problem("restart_backoff_s", spec.restart_backoff_s, c.MAX_RESTART_BACKOFF_S, "restart at once"),
        _seconds_problem("time_limit_s", spec.time_limit_s, c.MAX_TIME_LIMIT_S, "no limit"),
        _seconds_problem("checkpoint.interval_s", spec.checkpoint.interval_s, c.MAX_CHECKPOINT_INTERVAL_S,
                         "no time-based saves"),
    ):
        if problem_or_none:
            yield problem_or_none
    ck = spec.checkpoint
    if not 0 <= ck.every_steps <= c.MAX_CHECKPOINT_STEPS:
        yield (f"checkpoint.every_steps must be between 0 (the script decides) and {c.MAX_CHECKPOINT_STEPS}, "
               f"got {ck.every_steps}")
    if not 0 <= ck.keep_last <= c.MAX_KEEP_LAST:
        yield (f"checkpoint.keep_last must be between 0 (the store's default) and {c.MAX_KEEP_LAST}, got "
               f"{ck.keep_last}")


def validate_team(team: str) -> None:
    if not c.TEAM.matches(team):
        raise InvalidArgument(f"team {team[:80]!r} must be {c.TEAM.rule}")


def check_priority_class(spec: JobSpec, known: Collection[str]) -> None:
    """Refuse a priority class the scheduler does not define ("" is the default class)."""
    if spec.priority_class and spec.priority_class not in known:
        raise FailedPrecondition(f"priority_class {spec.priority_class!r} is not defined; classes: "
                                 f"{', '.join(sorted(known)) or 'none'} (or empty for the default)")


def check_queue(spec: JobSpec, known: Collection[str]) -> None:
    """Refuse a queue no operator created ("default" always exists)."""
    if spec.queue != c.DEFAULT_QUEUE and spec.queue not in known:
        names = sorted({c.DEFAULT_QUEUE, *known})
        raise FailedPrecondition(f"queue {spec.queue!r} does not exist; queues: {', '.join(names)}")


def _parse_cc(cc: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in cc.split(".")) if cc else ()
    except ValueError:
        return ()


def gpu_matches(r: Resources, gpu: Gpu) -> bool:
    """Whether a GPU's model is one the request accepts (the scheduler's accelerator filter, statically)."""
    if r.accelerator and gpu.model != r.accelerator:
        return False
    if r.accelerators and gpu.model not in r.accelerators:
        return False
    if r.vendor and gpu.vendor.lower() != r.vendor.lower():
        return False
    if r.min_memory_gb and gpu.memory_mb < r.min_memory_gb * 1000:
        return False
    if r.min_compute_capability:
        have = _parse_cc(gpu.compute_capability)
        if not have or have < _parse_cc(r.min_compute_capability):
            return False
    return True


def _describe_request(r: Resources) -> str:
    parts = []
    if r.accelerator:
        parts.append(f"accelerator={r.accelerator}")
    if r.accelerators:
        parts.append(f"accelerators={','.join(r.accelerators)}")
    for name, value in (("vendor", r.vendor), ("min_memory_gb", r.min_memory_gb),
                        ("min_compute_capability", r.min_compute_capability)):
        if value:
            parts.append(f"{name}={value}")
    return ", ".join(parts)


def _describe_models(fleet: Iterable[Node]) -> str:
    models: dict[str, Gpu] = {}
    for n in fleet:
        for g in n.gpus:
            models.setdefault(g.model, g)
    return ", ".join(f"{m} ({g.vendor or '?'}, {g.memory_mb // 1000} GB, cc {g.compute_capability or '?'})"
                     for m, g in sorted(models.items())) or "none"


def check_fits_fleet(spec: JobSpec, nodes: Iterable[Node]) -> None:
    """FailedPrecondition for a job no amount of waiting could place on the registered fleet: no accepted
    model, more GPUs (of one accepted model) per node than any node has, fewer such nodes than the gang
    needs, too few CPUs, or a CPU task on a fleet without CPU-only nodes. Health and current use are
    ignored: they change."""
    fleet = list(nodes)
    if not fleet:
        return  # nothing registered yet (a fresh cluster): the job waits for nodes
    r = spec.resources
    if r.cpu_only:
        _check_cpu_task(r, fleet)
        return
    if r.accelerator and not any(g.model == r.accelerator for n in fleet for g in n.gpus):
        models = sorted({g.model for n in fleet for g in n.gpus})
        raise FailedPrecondition(f"resources.accelerator {r.accelerator!r} matches no node; "
                                 f"models in the fleet: {', '.join(models) or 'none'}")
    # Per node: GPUs of each accepted model (a node's share of a gang is always of one model).
    counts = [(n, _count_by_model(r, n)) for n in fleet]
    if not any(n.gpus for n in fleet):
        raise FailedPrecondition(f"resources.gpus_per_node={r.gpus_per_node} asks for GPUs, and the fleet's "
                                 f"{len(fleet)} node(s) have none; use resources.gpus_per_node=0 for a CPU task")
    if not any(by_model for _, by_model in counts):
        raise FailedPrecondition(f"resources: no GPU in the fleet matches {_describe_request(r)}; models in the "
                                 f"fleet: {_describe_models(fleet)}")
    largest = max((max(by_model.values(), default=0) for _, by_model in counts), default=0)
    if r.gpus_per_node > largest:
        of = f" of an accepted model ({_describe_request(r)})" if _describe_request(r) else ""
        raise FailedPrecondition(f"resources.gpus_per_node={r.gpus_per_node} is more than any node has "
                                 f"(the largest has {largest} GPUs{of})")
    big = [(n, {m for m, k in by_model.items() if k >= r.gpus_per_node}) for n, by_model in counts]
    big = [(n, ms) for n, ms in big if ms]
    enough_cpus = [(n, ms) for n, ms in big if n.cpus >= r.cpus_per_node]
    if r.cpus_per_node and not enough_cpus:
        most = max((n.cpus for n, _ in big), default=0)
        raise FailedPrecondition(f"resources.cpus_per_node={r.cpus_per_node} is more than any node with "
                                 f"{r.gpus_per_node} GPUs has (the most is {most} CPUs)")
    if r.allow_mixed:
        available = len(enough_cpus)
        what = f"{r.gpus_per_node} or more accepted GPUs"
    else:
        per_model: dict[str, int] = {}
        for _, ms in enough_cpus:
            for m in ms:
                per_model[m] = per_model.get(m, 0) + 1
        available = max(per_model.values(), default=0)
        what = f"{r.gpus_per_node} or more GPUs of one accepted model"
        if r.nodes > available and len(per_model) > 1 and r.nodes <= len(enough_cpus):
            what += " (a gang uses one model unless resources.allow_mixed is set)"
    if r.cpus_per_node:
        what += f" and {r.cpus_per_node} or more CPUs"
    if r.nodes > available:
        raise FailedPrecondition(f"resources.nodes={r.nodes} is more than the {available} node(s) with {what} "
                                 "in the fleet")


class FleetFit:
    """`check_fits_fleet` remembered per request shape for one fleet: the fleet (a tuple, so the same object
    while no node record changed) changes on registration and health, not with every submit, and the check
    walks every node's GPUs, tens of milliseconds at 10,000 nodes. A fleet that is not a tuple (one that could
    change under the same object) is checked every time."""

    MAX_SHAPES = 256

    def __init__(self) -> None:
        self._fleet: object = None
        self._verdicts: dict[tuple[object, ...], str | None] = {}

    def check(self, spec: JobSpec, fleet: Sequence[Node]) -> None:
        if not isinstance(fleet, tuple):
            check_fits_fleet(spec, fleet)
            return
        if fleet is not self._fleet:
            self._fleet, self._verdicts = fleet, {}
        r = spec.resources
        # Everything the check reads of the request (speed hints do not decide whether a gang fits).
        shape = (r.nodes, r.gpus_per_node, r.accelerator, r.accelerators, r.min_memory_gb, r.min_compute_capability,
                 r.vendor, r.allow_mixed, r.cpus_per_node)
        if shape not in self._verdicts:
            try:
                check_fits_fleet(spec, fleet)
                verdict = None
            except FailedPrecondition as exc:
                verdict = exc.message
            if len(self._verdicts) >= self.MAX_SHAPES:
                self._verdicts.clear()
            self._verdicts[shape] = verdict
        verdict = self._verdicts[shape]
        if verdict is not None:
            raise FailedPrecondition(verdict)


def _count_by_model(r: Resources, node: Node) -> dict[str, int]:
    out: dict[str, int] = {}
    for g in node.gpus:
        if gpu_matches(r, g):
            out[g.model] = out.get(g.model, 0) + 1
    return out


def _check_cpu_task(r: Resources, fleet: list[Node]) -> None:
    cpu_nodes = [n for n in fleet if not n.gpus]
    if not cpu_nodes:
        raise FailedPrecondition("resources.gpus_per_node=0 asks for a CPU task, which runs only on CPU-only nodes "
                                 f"(nodes without GPUs), and none of the fleet's {len(fleet)} node(s) is one; ask "
                                 "for GPUs, or register CPU-only nodes first")
    need = max(1, r.cpus_per_node)
    fit = sum(1 for n in cpu_nodes if n.cpus >= need)
    if r.nodes > fit:
        raise FailedPrecondition(f"resources.nodes={r.nodes} is more than the {fit} CPU-only node(s) with {need} or "
                                 f"more CPUs in the fleet ({len(cpu_nodes)} CPU-only node(s) in all)")
