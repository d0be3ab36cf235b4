"""Jobs: the submit request (validated strictly: unknown fields, wrong types and out-of-range numbers are
refused with a message naming the field) and the job as the API returns it.

Limits that depend on the fleet (more GPUs per node than any node has, an unknown accelerator) are the
scheduler's to check; the bounds here only keep values sane and inside the proto's int32 fields.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from .common import ApiModel
from .queues import QUEUE_NAME_RE, QUEUE_NAME_RULE

INT32_MAX = 2**31 - 1
JOB_NAME_RULE = ("1-63 characters: lower-case letters, digits, '.', '_' or '-', starting and ending with a "
                 "letter or digit")
_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")
_ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,255}$")
_LABEL_KEY_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?$")

JobState = Literal["pending", "admitted", "running", "succeeded", "failed", "cancelled", "preempted",
                   "restarting", "unknown"]


_CC_RE = re.compile(r"^[0-9]{1,2}\.[0-9]{1,2}$")
TOPOLOGY_TIERS = Literal["", "node", "leaf", "spine", "zone"]
PREEMPTION_SIGNALS = Literal["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP"]
DAY_S = 86_400


def _seconds(limit: float, description: str) -> Any:
    return Field(strict=True, ge=0, le=limit, allow_inf_nan=False, description=description)


class ResourcesRequest(ApiModel):
    """What one gang needs. Name the accelerator exactly (`accelerator`), as any of several
    (`accelerators`), or as a class (`vendor`, `min_memory_gb`, `min_compute_capability`); the scheduler
    runs the job on the fastest acceptable model that fits."""

    nodes: Annotated[int, Field(strict=True, ge=1, le=10_000,
                                description="nodes in the gang; all are placed or none")]
    gpus_per_node: Annotated[int, Field(strict=True, ge=0, le=1024,
                                        description="GPUs, and worker processes, on each node; 0 makes a CPU task: "
                                                    "one worker per node, placed on CPU-only nodes")]
    accelerator: str = Field("", max_length=128,
                             description="exact accelerator model, e.g. H100-80GB-HBM3; empty for any. Not "
                                         "together with `accelerators`")
    accelerators: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(
        default_factory=list, max_length=16,
        description="any of these models (at most 16); the scheduler picks the fastest that fits",
        examples=[["H100-80GB-HBM3", "A100-SXM4-80GB"]])
    min_memory_gb: Annotated[int, Field(strict=True, ge=0, le=4096, description=(
        "only GPUs with at least this much memory (memory_mb >= min_memory_gb * 1000); 0: any"))] = 0
    min_compute_capability: str = Field("", max_length=8, description=(
        'only GPUs of at least this compute capability, e.g. "8.0" (Ampere) or "9.0" (Hopper); empty: any'))
    vendor: str = Field("", max_length=32, description='only GPUs of this vendor, e.g. "nvidia" or "amd"; '
                                                       "case-insensitive; empty: any")
    allow_mixed: Annotated[bool, Field(strict=True, description=(
        "let the gang span several accepted models (each node's share is still one model); by default a "
        "gang runs on one model"))] = False
    cpus_per_node: Annotated[int, Field(strict=True, ge=0, le=4096, description=(
        "CPUs held on each node; 0: not accounted (a CPU task then holds 1)"))] = 0
    speed_hints: dict[str, Annotated[float, Field(strict=True, gt=0, le=1000, allow_inf_nan=False)]] = Field(
        default_factory=dict, max_length=32,
        description="this job's relative throughput per GPU of each model (> 0, at most 1000), overriding the "
                    "scheduler's speed factors when it picks the fastest model",
        examples=[{"H100-80GB-HBM3": 2.5, "A100-SXM4-80GB": 1.0}])

    @field_validator("speed_hints")
    @classmethod
    def _hint_models(cls, value: dict[str, float]) -> dict[str, float]:
        for model in value:
            if not 1 <= len(model) <= 64:
                raise ValueError(f"accelerator model names must be 1-64 characters, got {model[:80]!r}")
        return value

    @field_validator("min_compute_capability")
    @classmethod
    def _cc(cls, value: str) -> str:
        if value and not _CC_RE.match(value):
            raise ValueError(f'must look like "8.0" or "9.0" (major.minor), got {value!r}')
        return value


class TopologyRequest(ApiModel):
    """Where in the network the gang should fit. The scheduler always packs a gang as low as it can
    (node ⊂ leaf switch ⊂ spine ⊂ zone); this makes it wait for a placement within `tier`."""

    tier: TOPOLOGY_TIERS = Field(default="", description='"node", "leaf", "spine" or "zone"; empty: no constraint')
    required: Annotated[bool, Field(strict=True, description=(
        "wait as long as it takes for a placement within `tier` (needs `tier`)"))] = False
    wait_s: Annotated[float, _seconds(7 * DAY_S, (
        "otherwise wait up to this many seconds after queueing for a placement within `tier`, then take "
        "the best there is (at most 7 days; needs `tier`)"))] = 0.0


class PreemptionRequest(ApiModel):
    """How the job is stopped when a job of higher standing preempts it."""

    signal: PREEMPTION_SIGNALS = Field(default="SIGTERM", description=(
        "signal sent first (a job that checkpoints on it can save its state)"))
    grace_s: Annotated[float, _seconds(3600, (
        "seconds between the signal and SIGKILL; 0: the scheduler's default grace"))] = 0.0


class CheckpointRequest(ApiModel):
    """The job's checkpoint policy, handed to its checkpoint library as TRAINYARD_CHECKPOINT_* variables."""

    every_steps: Annotated[int, Field(strict=True, ge=0, le=10**9, description=(
        "save every this many training steps; 0: the script decides"))] = 0
    interval_s: Annotated[float, _seconds(7 * DAY_S, (
        "save at least this often, in seconds; 0: no time-based saves"))] = 0.0
    keep_last: Annotated[int, Field(strict=True, ge=0, le=10_000, description=(
        "committed checkpoints the store keeps for the job; 0: the store's default retention"))] = 0


class JobSubmit(ApiModel):
    """Body of POST /v1/jobs."""

    name: str = Field(description=f"job name: {JOB_NAME_RULE}", examples=["llama-7b-pretrain"])
    command: list[Annotated[str, Field(max_length=32_768)]] = Field(
        min_length=1, max_length=4096, description="argv of every worker", examples=[["python", "train.py"]])
    env: dict[str, Annotated[str, Field(max_length=32_768)]] = Field(
        default_factory=dict, max_length=1024, description="environment added to every worker")
    resources: ResourcesRequest
    working_dir: str = Field("", max_length=4096,
                             description="absolute working directory of the workers; empty: a per-job one")
    queue: str = Field("", max_length=63, description="queue name (see GET /v1/queues); empty for the default "
                                                      "queue")
    priority: Annotated[int, Field(strict=True, ge=-INT32_MAX, le=INT32_MAX)] = 0
    max_restarts: Annotated[int, Field(strict=True, ge=0, le=1000, description=(
        "restarts allowed after a failed rank, each after an exponential backoff"))] = 0
    labels: dict[str, Annotated[str, Field(max_length=256)]] = Field(default_factory=dict, max_length=64)
    priority_class: str = Field("", max_length=63, description=(
        "priority class: low (-100, never preempts), normal (0), high (100) or critical (1000, never "
        "preempted), unless the operator configured others; empty: the default class (normal)"))
    topology: TopologyRequest = Field(default_factory=lambda: TopologyRequest())
    preemption: PreemptionRequest = Field(default_factory=lambda: PreemptionRequest())
    checkpoint: CheckpointRequest = Field(default_factory=lambda: CheckpointRequest())
    restart_backoff_s: Annotated[float | None, _seconds(3600, (
        "delay before the first restart, doubling for each further one (capped at 600 s); null or absent: "
        "10 s; 0: restart at once"))] = None
    time_limit_s: Annotated[float, _seconds(365 * DAY_S, (
        "wall-clock limit of one attempt in seconds, after which the job fails; 0: none. Jobs with a limit "
        "can backfill GPUs held for a blocked job"))] = 0.0

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _NAME_RE.match(value):
            raise ValueError(f"must be {JOB_NAME_RULE} (got {value[:80]!r})")
        return value

    @field_validator("command")
    @classmethod
    def _command(cls, value: list[str]) -> list[str]:
        if not value[0]:
            raise ValueError("the first element (the program) must not be empty")
        if any("\0" in arg for arg in value):
            raise ValueError("arguments must not contain NUL characters")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        for key, val in value.items():
            if not _ENV_KEY_RE.match(key):
                raise ValueError(f"variable name {key[:80]!r} must be letters, digits and '_', not starting "
                                 "with a digit")
            if "\0" in val:
                raise ValueError(f"value of {key} must not contain NUL characters")
        return value

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not _LABEL_KEY_RE.match(key):
                raise ValueError(f"label key {key[:80]!r} must be 1-63 letters, digits, '.', '_', '/' or '-', "
                                 "starting and ending with a letter or digit")
        return value

    @field_validator("working_dir")
    @classmethod
    def _working_dir(cls, value: str) -> str:
        if value and not value.startswith("/"):
            raise ValueError(f"must be an absolute path (got {value[:80]!r})")
        if "\0" in value:
            raise ValueError("must not contain NUL characters")
        return value

    @field_validator("queue")
    @classmethod
    def _queue(cls, value: str) -> str:
        if value and not QUEUE_NAME_RE.match(value):
            raise ValueError(f"must be {QUEUE_NAME_RULE} (got {value!r})")
        return value


class CancelRequest(ApiModel):
    """Optional body of POST /v1/jobs/{id}:cancel."""

    reason: str = Field("", max_length=1024, description="recorded in the job's events")


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


class Job(ApiModel):
    id: str
    name: str
    state: JobState
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


class JobList(ApiModel):
    jobs: list[Job]
    next_page_token: str = Field(description="pass as page_token for the next page; empty on the last page")
