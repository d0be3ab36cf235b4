"""A job's checkpoints as the API shows them (GET /v1/jobs/{job_id}/checkpoints and below), and the manifest a
download tool reads.

What is shown is what the checkpoint-store records, nothing derived: the step and attempt that saved it, the
job's lineage as the job declared it at Begin (code version, parameters, spec), the shards' sizes, the tags
and the state with its times. The store records no "parent" checkpoint (which checkpoint a resumed attempt
loaded), so none is shown; `attempt` and `step` place a checkpoint in the job's run.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from pydantic import Field

from trainyard_core import contract as c

from .common import ApiModel, OneOf

CHECKPOINT_STATE_NAMES = (*c.CHECKPOINT_STATES, "unknown")  # "unknown": a state this gateway does not know yet
CheckpointStateName = Annotated[str, OneOf(CHECKPOINT_STATE_NAMES)]


class CheckpointLineage(ApiModel):
    code_version: str = Field(description="the code the job ran, as it declared it (e.g. a git commit; the "
                                          "checkpoint library records TRAINYARD_CODE_VERSION); empty when none")
    parameters: dict[str, str] = Field(description="the run's parameters as the job declared them")
    job_spec: dict[str, Any] | None = Field(description="the job's spec as the job declared it at Begin; only in "
                                                        "the answer for one checkpoint (null in lists, and when "
                                                        "none was declared)")


class JobCheckpoint(ApiModel):
    id: str
    job_id: str
    team: str = Field(description="the job's team")
    attempt: int = Field(description="the attempt of the job that saved it")
    step: int = Field(description="the training step it holds")
    world_size: int = Field(description="ranks that wrote it")
    state: CheckpointStateName = Field(description=(
        "writing (shards being written; nothing restores from it), committed (verified and restorable), "
        "aborted (the save was given up), damaged (committed, then found damaged in storage; never restored "
        "from), deleted (its files are removed)"))
    latest: bool = Field(description="the job's latest committed checkpoint: what a restarting job resumes from "
                                     "(it cannot be deleted)")
    tags: list[str] = Field(description="a tag keeps a committed checkpoint from retention and GC")
    size_bytes: int = Field(description="the sum of its shards' sizes (0 until committed)")
    shard_count: int = Field(description="files it is made of (0 until committed); the manifest lists them")
    location: str = Field(description="URL of its directory in the checkpoint storage (file:///... or s3://...)")
    metadata: dict[str, str] = Field(description="what the saver recorded (format, torch version, ...)")
    lineage: CheckpointLineage
    created_at: datetime | None
    committed_at: datetime | None
    aborted_at: datetime | None
    abort_reason: str = Field(description="why the save was given up; empty unless aborted")
    damaged_at: datetime | None
    damage: str = Field(description="what the checkpoint-store found damaged; empty unless damaged")
    deleted_at: datetime | None


class CheckpointList(ApiModel):
    checkpoints: list[JobCheckpoint]
    next_page_token: str = Field(description="pass as page_token for the next page; empty on the last page")


class ShardFile(ApiModel):
    path: str = Field(description="relative to the checkpoint's location")
    rank: int = Field(description="the rank that wrote it")
    size_bytes: int
    checksum: str = Field(description='"xxh3c:<chunk bytes>:<hex>.<hex>..." (XXH3-64 per chunk), "xxh3:<16 hex>" or '
                                      '"crc32c:<8 hex>"')


class CheckpointManifest(ApiModel):
    """Every file of a committed checkpoint, for tools that download or verify it."""

    checkpoint_id: str
    job_id: str
    step: int
    world_size: int
    state: CheckpointStateName = Field(description="committed, or damaged (the files may not verify)")
    location: str = Field(description="URL of the checkpoint's directory; each shard's path is relative to it")
    manifest_file: str = Field(description="the manifest the checkpoint-store wrote into the location at commit "
                                           "(relative to it)")
    size_bytes: int
    shards: list[ShardFile]
