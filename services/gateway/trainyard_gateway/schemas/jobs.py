"""Jobs: the submit request (validated strictly: unknown fields, wrong types and out-of-range numbers are
refused with a message naming the field) and the job as the API returns it.

Limits that depend on the fleet (more GPUs per node than any node has, an unknown accelerator) are the
scheduler's to check; the bounds here only keep values sane and inside the proto's int32 fields.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Literal

from pydantic import Field, field_validator

from .common import ApiModel

INT32_MAX = 2**31 - 1
JOB_NAME_RULE = ("1-63 characters: lower-case letters, digits, '.', '_' or '-', starting and ending with a "
                 "letter or digit")
_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")
_ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,255}$")
_LABEL_KEY_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?$")
_QUEUE_RE = re.compile(r"^[a-z0-9]([a-z0-9_-]{0,61}[a-z0-9])?$")

JobState = Literal["pending", "admitted", "running", "succeeded", "failed", "cancelled", "preempted",
                   "restarting", "unknown"]


class ResourcesRequest(ApiModel):
    nodes: Annotated[int, Field(strict=True, ge=1, le=10_000,
                                description="nodes in the gang; all are placed or none")]
    gpus_per_node: Annotated[int, Field(strict=True, ge=1, le=1024,
                                        description="GPUs, and worker processes, on each node")]
    accelerator: str = Field("", max_length=128,
                             description="exact accelerator model, e.g. H100-SXM5-80GB; empty for any")


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
    queue: str = Field("", max_length=63, description="queue name; empty for the default queue")
    priority: Annotated[int, Field(strict=True, ge=-INT32_MAX, le=INT32_MAX)] = 0
    max_restarts: Annotated[int, Field(strict=True, ge=0, le=1000)] = 0
    labels: dict[str, Annotated[str, Field(max_length=256)]] = Field(default_factory=dict, max_length=64)

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
        if value and not _QUEUE_RE.match(value):
            raise ValueError("must be 1-63 lower-case letters, digits, '-' or '_', starting and ending with a "
                             f"letter or digit (got {value!r})")
        return value


class CancelRequest(ApiModel):
    """Optional body of POST /v1/jobs/{id}:cancel."""

    reason: str = Field("", max_length=1024, description="recorded in the job's events")


class Resources(ApiModel):
    nodes: int
    gpus_per_node: int
    accelerator: str


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


class NodeAssignment(ApiModel):
    node_id: str
    node_rank: int
    gpu_indices: list[int]
    ranks: list[int] = Field(description="global ranks of the workers on this node")


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


class JobList(ApiModel):
    jobs: list[Job]
    next_page_token: str = Field(description="pass as page_token for the next page; empty on the last page")
