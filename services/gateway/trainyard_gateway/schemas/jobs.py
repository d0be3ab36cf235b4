"""Jobs: the submit request (validated strictly: unknown fields, wrong types and out-of-range numbers are
refused with a message naming the field) and the job as the API returns it.

Every bound and name rule is `trainyard_core.contract`'s, the scheduler's own, so a spec this schema
calls valid is not refused by the scheduler for its form. What it may still refuse, with 409
failed_precondition, is what depends on the cluster: more GPUs per node than any node has, a queue or
priority class that does not exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator

from trainyard_core import contract as c

from .common import ApiModel, Bool, Number, OneOf, integer, keys_matching, matching, with_rules

JOB_STATE_NAMES = (*c.JOB_STATES, "unknown")  # "unknown": a state this gateway does not know yet
JobStateName = Annotated[str, OneOf(JOB_STATE_NAMES)]
Model = Annotated[str, Field(pattern=c.MODEL_NAME.pattern)]
Arg = Annotated[str, Field(max_length=c.MAX_ARG_LENGTH, pattern=c.NO_NUL.pattern)]
EnvKey = Annotated[str, matching(c.ENV_KEY)]
EnvValue = Annotated[str, Field(max_length=c.MAX_ENV_VALUE_LENGTH, pattern=c.NO_NUL.pattern)]
LabelKey = Annotated[str, matching(c.LABEL_KEY)]
ModelKey = Annotated[str, matching(c.MODEL_NAME)]
SpeedHint = Annotated[Number, Field(gt=0, le=c.MAX_SPEED_HINT)]


def _seconds(limit: float, description: str) -> Any:
    return Field(ge=0, le=limit, description=description)


_EMPTY: dict[str, Any] = {"maxLength": 0}
# JSON Schema of the rules between fields that ResourcesRequest._related checks.
RESOURCES_RULES = (
    {"not": {"required": ["accelerator", "accelerators"],
             "properties": {"accelerator": {"minLength": 1}, "accelerators": {"minItems": 1}}}},
    {"if": {"required": ["gpus_per_node"], "properties": {"gpus_per_node": {"const": 0}}},
     "then": {"properties": {"accelerator": _EMPTY, "accelerators": {"maxItems": 0}, "min_memory_gb": {"const": 0},
                             "min_compute_capability": _EMPTY, "vendor": _EMPTY}}},
)
# And the ones TopologyRequest._related checks.
TOPOLOGY_RULES = (
    {"if": {"required": ["required"], "properties": {"required": {"const": True}}},
     "then": {"required": ["tier"], "properties": {"tier": {"minLength": 1}, "wait_s": {"const": 0}}}},
    {"if": {"required": ["wait_s"], "properties": {"wait_s": {"exclusiveMinimum": 0}}},
     "then": {"required": ["tier"], "properties": {"tier": {"minLength": 1}}}},
)


class ResourcesRequest(ApiModel):
    """What one gang needs. Name the accelerator exactly (`accelerator`), as any of several
    (`accelerators`), or as a class (`vendor`, `min_memory_gb`, `min_compute_capability`); the scheduler
    runs the job on the fastest acceptable model that fits."""

    model_config = ApiModel.model_config | {"json_schema_extra": with_rules(*RESOURCES_RULES)}

    nodes: int = integer(ge=1, le=c.MAX_NODES, description="nodes in the gang; all are placed or none")
    gpus_per_node: int = integer(ge=0, le=c.MAX_GPUS_PER_NODE, description=(
        "GPUs, and worker processes, on each node; 0 makes a CPU task: one worker per node, placed on CPU-only "
        "nodes, naming no GPU (no accelerator, accelerators, min_memory_gb, min_compute_capability or vendor)"))
    accelerator: str = Field("", pattern=c.MODEL_NAME.or_empty.pattern,
                             description="exact accelerator model, e.g. H100-80GB-HBM3; empty for any. Not "
                                         "together with `accelerators`")
    accelerators: list[Model] = Field(
        default_factory=list, max_length=c.MAX_ACCELERATORS, json_schema_extra={"uniqueItems": True},
        description=f"any of these models (at most {c.MAX_ACCELERATORS}, each once); the scheduler picks the "
                    "fastest that fits",
        examples=[["H100-80GB-HBM3", "A100-SXM4-80GB"]])
    min_memory_gb: int = integer(0, ge=0, le=c.MAX_MEMORY_GB, description=(
        "only GPUs with at least this much memory (memory_mb >= min_memory_gb * 1000); 0: any"))
    min_compute_capability: str = Field("", pattern=c.COMPUTE_CAPABILITY.or_empty.pattern, description=(
        'only GPUs of at least this compute capability, e.g. "8.0" (Ampere) or "9.0" (Hopper); empty: any'))
    vendor: str = Field("", max_length=c.MAX_VENDOR_LENGTH,
                        description='only GPUs of this vendor, e.g. "nvidia" or "amd"; case-insensitive; empty: any')
    allow_mixed: Annotated[Bool, Field(description=(
        "let the gang span several accepted models (each node's share is still one model); by default a "
        "gang runs on one model"))] = False
    cpus_per_node: int = integer(0, ge=0, le=c.MAX_CPUS_PER_NODE, description=(
        "CPUs held on each node; 0: not accounted (a CPU task then holds 1)"))
    speed_hints: dict[ModelKey, SpeedHint] = Field(
        default_factory=dict, max_length=c.MAX_SPEED_HINTS, json_schema_extra=keys_matching(c.MODEL_NAME),
        description=f"this job's relative throughput per GPU of each model (> 0, at most {c.MAX_SPEED_HINT:g}), "
                    "overriding the scheduler's speed factors when it picks the fastest model",
        examples=[{"H100-80GB-HBM3": 2.5, "A100-SXM4-80GB": 1.0}])

    @field_validator("accelerators")
    @classmethod
    def _once_each(cls, value: list[str]) -> list[str]:
        twice = sorted({m for m in value if value.count(m) > 1})
        if twice:
            raise ValueError(f"lists {', '.join(twice)} more than once")
        return value

    @model_validator(mode="after")
    def _related(self) -> ResourcesRequest:
        if self.accelerator and self.accelerators:
            raise ValueError("give either accelerator (one exact model) or accelerators (any of several), not both")
        if self.gpus_per_node == 0:
            asked = [name for name in ("accelerator", "accelerators", "min_memory_gb", "min_compute_capability",
                                       "vendor") if getattr(self, name)]
            if asked:
                raise ValueError(f"gpus_per_node=0 is a CPU task, which gets no GPU: remove {', '.join(asked)}, or "
                                 "ask for GPUs")
        return self


class TopologyRequest(ApiModel):
    """Where in the network the gang should fit. The scheduler always packs a gang as low as it can
    (node ⊂ leaf switch ⊂ spine ⊂ zone); this makes it wait for a placement within `tier`."""

    model_config = ApiModel.model_config | {"json_schema_extra": with_rules(*TOPOLOGY_RULES)}

    tier: Annotated[str, OneOf(("", *c.TOPOLOGY_TIERS))] = Field(
        default="", description=f"{', '.join(c.TOPOLOGY_TIERS)}; empty: no constraint")
    required: Annotated[Bool, Field(description=(
        "wait as long as it takes for a placement within `tier` (needs `tier`; not with `wait_s`)"))] = False
    wait_s: Annotated[Number, _seconds(c.MAX_TOPOLOGY_WAIT_S, (
        "otherwise wait up to this many seconds after queueing for a placement within `tier`, then take "
        "the best there is (at most 7 days; needs `tier`)"))] = 0.0

    @model_validator(mode="after")
    def _related(self) -> TopologyRequest:
        if self.required and not self.tier:
            raise ValueError("required needs tier (the domain the gang must fit in)")
        if self.wait_s and not self.tier:
            raise ValueError("wait_s needs tier (the domain to wait for)")
        if self.wait_s and self.required:
            raise ValueError("wait_s applies only when required is false (required waits without a limit); set "
                             "one of them")
        return self


class PreemptionRequest(ApiModel):
    """How the job is stopped when a job of higher standing preempts it."""

    signal: Annotated[str, OneOf(c.PREEMPTION_SIGNALS)] = Field(default=c.DEFAULT_PREEMPTION_SIGNAL, description=(
        "signal sent first (a job that checkpoints on it can save its state)"))
    grace_s: Annotated[Number, _seconds(c.MAX_GRACE_S, (
        "seconds between the signal and SIGKILL; 0: the scheduler's default grace"))] = 0.0


class CheckpointRequest(ApiModel):
    """The job's checkpoint policy, handed to its checkpoint library as TRAINYARD_CHECKPOINT_* variables."""

    every_steps: int = integer(0, ge=0, le=c.MAX_CHECKPOINT_STEPS, description=(
        "save every this many training steps; 0: the script decides"))
    interval_s: Annotated[Number, _seconds(c.MAX_CHECKPOINT_INTERVAL_S, (
        "save at least this often, in seconds; 0: no time-based saves"))] = 0.0
    keep_last: int = integer(0, ge=0, le=c.MAX_KEEP_LAST, description=(
        "committed checkpoints the store keeps for the job; 0: the store's default retention"))


_PROGRAM: dict[str, Any] = {"type": "string", "maxLength": c.MAX_ARG_LENGTH, "pattern": c.PROGRAM.pattern}
_RESERVED_ENV = {"anyOf": [{"enum": list(c.RESERVED_ENV)}, {"pattern": f"^{c.RESERVED_ENV_PREFIX}"}]}


class JobSubmit(ApiModel):
    """Body of POST /v1/jobs."""

    name: str = Field(pattern=c.JOB_NAME.pattern, description=f"job name: {c.JOB_NAME.rule}",
                      examples=["llama-7b-pretrain"])
    command: list[Arg] = Field(
        min_length=1, max_length=c.MAX_COMMAND_ARGS, json_schema_extra={"prefixItems": [_PROGRAM]},
        description=f"argv of every worker: the program, then its arguments; at most {c.MAX_COMMAND_ARGS} of "
                    f"at most {c.MAX_ARG_LENGTH} characters each, and at most {c.MAX_COMMAND_LENGTH} characters "
                    "together",
        examples=[["python", "train.py"]])
    env: dict[EnvKey, EnvValue] = Field(
        default_factory=dict, max_length=c.MAX_ENV_VARS,
        json_schema_extra=keys_matching(c.ENV_KEY, **{"not": _RESERVED_ENV}),
        description="environment added to every worker; the variables Trainyard sets (MASTER_ADDR, RANK, ..., "
                    f"{c.RESERVED_ENV_PREFIX}*) cannot be set")
    resources: ResourcesRequest
    working_dir: str = Field("", max_length=c.MAX_WORKING_DIR_LENGTH, pattern=c.WORKING_DIR.pattern,
                             description="absolute working directory of the workers; empty: a per-job one")
    queue: str = Field("", pattern=c.QUEUE_NAME.or_empty.pattern,
                       description="queue name (see GET /v1/queues); empty for the default queue")
    priority: int = integer(0, ge=c.MIN_PRIORITY, le=c.MAX_PRIORITY, description=(
        "order within the same queue tier and priority class (higher first)"))
    max_restarts: int = integer(0, ge=0, le=c.MAX_RESTARTS, description=(
        "restarts allowed after a failed rank, each after an exponential backoff"))
    labels: dict[LabelKey, Annotated[str, Field(max_length=c.MAX_LABEL_VALUE_LENGTH)]] = Field(
        default_factory=dict, max_length=c.MAX_LABELS, json_schema_extra=keys_matching(c.LABEL_KEY))
    priority_class: str = Field("", pattern=c.PRIORITY_CLASS.or_empty.pattern, description=(
        "priority class: low (-100, never preempts), normal (0), high (100) or critical (1000, never "
        "preempted), unless the operator configured others; empty: the default class (normal)"))
    topology: TopologyRequest = Field(default_factory=lambda: TopologyRequest())
    preemption: PreemptionRequest = Field(default_factory=lambda: PreemptionRequest())
    checkpoint: CheckpointRequest = Field(default_factory=lambda: CheckpointRequest())
    restart_backoff_s: Annotated[Number | None, _seconds(c.MAX_RESTART_BACKOFF_S, (
        "delay before the first restart, doubling for each further one (capped at 600 s); null or absent: "
        f"{c.DEFAULT_RESTART_BACKOFF_S:g} s; 0: restart at once"))] = None
    time_limit_s: Annotated[Number, _seconds(c.MAX_TIME_LIMIT_S, (
        "wall-clock limit of one attempt in seconds, after which the job fails; 0: none. Jobs with a limit "
        "can backfill GPUs held for a blocked job"))] = 0.0

    @field_validator("command")
    @classmethod
    def _command(cls, value: list[str]) -> list[str]:
        if not c.PROGRAM.matches(value[0]):
            raise ValueError(f"the first element must be {c.PROGRAM.rule}")
        if sum(len(arg) for arg in value) > c.MAX_COMMAND_LENGTH:
            raise ValueError(f"at most {c.MAX_COMMAND_LENGTH} characters, every argument together")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if key in c.RESERVED_ENV or key.startswith(c.RESERVED_ENV_PREFIX):
                raise ValueError(f"{key} is set by Trainyard for every worker and cannot be overridden")
        return value


class CancelRequest(ApiModel):
    """Optional body of POST /v1/jobs/{id}:cancel."""

    reason: str = Field("", max_length=c.MAX_REASON_LENGTH, description="recorded in the job's events")


class Resources(ApiModel):
    nodes: int
    gpus_per_node: int
    accelerator: str
    accelerators: list[str]
    min_memory_gb: int
    min_compute_capability: str
    vendor: str
    allow_mixed: bool
    cpus_per_node: int
    speed_hints: dict[str, float]


class Topology(ApiModel):
    tier: str
    required: bool
    wait_s: float


class Preemption(ApiModel):
    signal: str
    grace_s: float


class Checkpoint(ApiModel):
    every_steps: int
    interval_s: float
    keep_last: int


class JobSpec(ApiModel):
    name: str
    command: list[str]
    env: dict[str, str]
    resources: Resources
    working_dir: str
    queue: str
    priority: int
    max_restarts: int
    labels: dict[str, str]
    priority_class: str = Field(description="empty: the scheduler's default class")
    topology: Topology
    preemption: Preemption
    restart_backoff_s: float = Field(description="delay before the first restart (10 unless the job set it)")
    time_limit_s: float = Field(description="wall-clock limit of one attempt; 0: none")
    checkpoint: Checkpoint = Field(default_factory=lambda: Checkpoint(every_steps=0, interval_s=0.0, keep_last=0))


class NodeAssignment(ApiModel):
    node_id: str
    node_rank: int
    gpu_indices: list[int]
    ranks: list[int] = Field(description="global ranks of the workers on this node")
    model: str = Field("", description="accelerator model of this node's share; empty for a CPU task")
    cpus: int = Field(0, description="CPUs this share holds on the node")


class WorkerExit(ApiModel):
    rank: int
    node_id: str
    exit_code: int
    signal: int = Field(description="signal that ended the worker; 0 when it exited by itself")
    exited_at: datetime | None


class JobEvent(ApiModel):
    at: datetime | None
    kind: str
    message: str


class JobAttempt(ApiModel):
    attempt: int
    started_at: datetime | None = Field(description="its gang was placed")
    ended_at: datetime | None = Field(description="its gang was released (every worker gone)")
    nodes: list[str]
    gpus: int
    cpus: int
    model: str = Field(description="the gang's accelerator model ('+'-joined when mixed; empty for CPU only)")
    outcome: JobStateName = Field(description="the state the job went to when the attempt ended")
    reason: str = Field(description="why the gang was stopped; empty when every worker exited 0")


class Job(ApiModel):
    id: str
    name: str
    state: JobStateName
    team: str
    user: str
    spec: JobSpec
    attempt: int
    exit_code: int | None = Field(description="exit code of the first failing worker once the job ended; "
                                              "null before")
    message: str = Field(description="human-readable reason for the current state")
    cancel_requested: bool
    placement: list[NodeAssignment]
    exits: list[WorkerExit]
    events: list[JobEvent]
    created_at: datetime | None
    updated_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    restarts: int = Field(0, description=("restarts used after failures (counted against spec.max_restarts; "
                                          "requeues after preemption do not count)"))
    infra_restarts: int = Field(0, description=("restarts after infrastructure failures (a lost node, an "
                                                "unhealthy GPU); not counted against spec.max_restarts"))
    queued_at: datetime | None = Field(None, description=("when the job last entered pending (submission, or "
                                                          "requeue after a preemption or restart)"))
    not_before: datetime | None = Field(None, description="while restarting: not placed again before this time")
    preempted_by: list[str] = Field(default_factory=list,
                                    description="ids of the jobs that preempted this one, oldest first")
    last_checkpoint_at: datetime | None = Field(None, description="the job's latest committed checkpoint; null "
                                                                  "when none")
    cancelled_by: str = Field("", description="who cancelled the job (a user, or tool:<name>); empty unless a "
                                              "cancel was asked")
    attempts: list[JobAttempt] = Field(default_factory=list,
                                       description="every attempt that was placed and has ended, oldest first "
                                                   "(the latest 200): where it ran, on what, and why it ended")
    held_by: str = Field("", description="who holds the pending job back from placement (POST "
                                         "/v1/jobs/{id}:hold); empty when it is not held")
    hold_reason: str = Field("", description="why it is held, as the holder said")
    requeue_requested_by: str = Field("", description="who asked for the placed job to be requeued; empty unless "
                                                      "one was asked and its workers are not stopped yet")


class JobList(ApiModel):
    jobs: list[Job]
    next_page_token: str = Field(description="pass as page_token for the next page, with the same filters; empty "
                                             "on the last page")


@dataclass(frozen=True, slots=True)
class JobQuery:
    """The filters of a job listing (GET /v1/jobs), as the scheduler takes them: every one set must match."""

    team: str = ""
    user: str = ""
    states: tuple[str, ...] = ()
    queue: str = ""
    labels: tuple[tuple[str, str], ...] = ()
    name_prefix: str = ""
    submitted_after: datetime | None = None
    submitted_before: datetime | None = None
    finished_after: datetime | None = None
    finished_before: datetime | None = None
