"""/v1/jobs/{job_id}/checkpoints: a job's checkpoints (list, get, manifest) and what a user may change about them
(tag, untag, delete), through the checkpoint-store.

Scoping is the job's: the job is read from the scheduler under the caller's role first, so another team's job
is 404 (as on every job route) and the checkpoint-store is asked for the job's team (access.py binds the
gateway's calls to it). A viewer of the team reads; a member changes its own jobs' checkpoints, a team admin
any of its team's, an operator any (roles.check_checkpoint_write). A checkpoint id of another job answers 404.
Without a checkpoint_store_address the routes answer 503 saying so; they are always in the document, so
clients and the OpenAPI contract do not change with a setting.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from trainyard.checkpoint.v1 import checkpoint_pb2 as pb
from trainyard_core import contract as c
from trainyard_core.errors import FailedPrecondition, NotFound, Unavailable

from .. import roles
from ..auth import CheckpointReader, CheckpointWriter, Deps, team_scope
from ..checkpoint_client import CheckpointStoreClient, manifest_from_pb, state_name
from ..deps import GatewayDeps
from ..schemas.checkpoints import CheckpointList, CheckpointManifest, JobCheckpoint
from ..schemas.common import error_responses
from ..schemas.jobs import Job
from ..tokens import TokenRecord
from .params import CheckpointId, CheckpointTag, JobId

router = APIRouter(prefix="/v1/jobs/{job_id}/checkpoints", tags=["checkpoints"])

NO_STORE = ("this gateway has no checkpoint-store configured (its checkpoint_store_address setting is empty), so "
            "it cannot show or change checkpoints; ask an operator")
_WRITE_ERRORS = error_responses(400, 401, 403, 404, 409, 429, 503, 507)


def _store(deps: GatewayDeps) -> CheckpointStoreClient:
    if deps.checkpoints is None:
        raise Unavailable(NO_STORE)
    return deps.checkpoints


async def _job(deps: GatewayDeps, job_id: str, principal: TokenRecord, action: roles.Action) -> Job:
    """The job, if the caller's role sees it (404 otherwise, from the scheduler)."""
    return await deps.scheduler.get_job(job_id, team=team_scope(principal, action))


async def _checkpoint_of(store: CheckpointStoreClient, job: Job, checkpoint_id: str) -> pb.Checkpoint:
    ckpt = await store.get(checkpoint_id, team=job.team)
    if ckpt.job_id != job.id:  # the store binds an id to its team, not to the job the path names
        raise NotFound(f"checkpoint {checkpoint_id} not found in job {job.id}")
    return ckpt


async def _writable(deps: GatewayDeps, job_id: str, checkpoint_id: str,
                    principal: TokenRecord) -> tuple[CheckpointStoreClient, Job]:
    job = await _job(deps, job_id, principal, roles.Action.CHECKPOINTS_WRITE)
    roles.check_checkpoint_write(principal, job.user)
    store = _store(deps)
    await _checkpoint_of(store, job, checkpoint_id)
    return store, job


@router.get("", response_model=CheckpointList, summary="List a job's checkpoints, oldest first",
            description="Every checkpoint of the job in the order they were begun, in every state (deleted ones "
                        "stay listed as tombstones until garbage collection drops them), one page at a time. A "
                        "page token is the last id of the page before, so checkpoints begun while you page "
                        "appear on later pages and never shift earlier ones. Lists leave out `lineage.job_spec` "
                        "(null); get one checkpoint for it, and its manifest for its files.",
            responses=error_responses(400, 401, 403, 404, 429, 503))
async def list_checkpoints(
    job_id: JobId,
    principal: CheckpointReader,
    deps: Deps,
    page_size: Annotated[int, Query(ge=1, le=c.MAX_PAGE_SIZE,
                                    description="checkpoints per page")] = c.DEFAULT_PAGE_SIZE,
    page_token: Annotated[str, Query(pattern=c.CHECKPOINT_ID.or_empty.pattern,
                                     description="next_page_token of the previous page")] = "",
) -> CheckpointList:
    job = await _job(deps, job_id, principal, roles.Action.CHECKPOINTS_READ)
    return await _store(deps).list(job.id, team=job.team, page_size=page_size, page_token=page_token)


@router.get("/{checkpoint_id}", response_model=JobCheckpoint, summary="Get one checkpoint of a job",
            description="With its lineage (`lineage.job_spec`: the job's spec as the job declared it) and whether "
                        "it is the job's latest.",
            responses=error_responses(400, 401, 403, 404, 429, 503))
async def get_checkpoint(job_id: JobId, checkpoint_id: CheckpointId, principal: CheckpointReader,
                         deps: Deps) -> JobCheckpoint:
    job = await _job(deps, job_id, principal, roles.Action.CHECKPOINTS_READ)
    store = _store(deps)
    return await store.shown(await _checkpoint_of(store, job, checkpoint_id), team=job.team)


@router.get("/{checkpoint_id}/manifest", response_model=CheckpointManifest,
            summary="The files of a committed checkpoint, for download",
            description="Every shard with its path (relative to `location`), rank, size and checksum, as verified "
                        "by the checkpoint-store at commit. 409 `failed_precondition` for a checkpoint that is "
                        "still writing, was aborted or is deleted; a damaged one is answered (its `state` says "
                        "so: its files may not verify).",
            responses=error_responses(400, 401, 403, 404, 409, 429, 503))
async def get_manifest(job_id: JobId, checkpoint_id: CheckpointId, principal: CheckpointReader,
                       deps: Deps) -> CheckpointManifest:
    job = await _job(deps, job_id, principal, roles.Action.CHECKPOINTS_READ)
    ckpt = await _checkpoint_of(_store(deps), job, checkpoint_id)
    if ckpt.state not in (pb.CHECKPOINT_STATE_COMMITTED, pb.CHECKPOINT_STATE_DAMAGED):
        why = {pb.CHECKPOINT_STATE_WRITING: "its files are fixed when it is committed",
               pb.CHECKPOINT_STATE_ABORTED: "it was never committed",
               pb.CHECKPOINT_STATE_DELETED: "its files are removed"}.get(ckpt.state, "it was never committed")
        raise FailedPrecondition(f"checkpoint {checkpoint_id} is {state_name(ckpt.state)}: it has no manifest "
                                 f"({why})")
    return manifest_from_pb(ckpt)


@router.put("/{checkpoint_id}/tags/{tag}", response_model=JobCheckpoint, summary="Tag a checkpoint (idempotent)",
            description="A tag keeps a committed checkpoint from retention and garbage collection (\"best\", "
                        "\"release-1.0\"); tagging it again with a tag it has changes nothing. 409 "
                        "`failed_precondition` for a checkpoint that is not committed, or has 16 tags already. A "
                        "member tags its own jobs' checkpoints; a team admin any of its team's.",
            responses=_WRITE_ERRORS)
async def tag_checkpoint(job_id: JobId, checkpoint_id: CheckpointId, tag: CheckpointTag,
                         principal: CheckpointWriter, deps: Deps) -> JobCheckpoint:
    store, job = await _writable(deps, job_id, checkpoint_id, principal)
    return await store.shown(await store.tag(checkpoint_id, tag, team=job.team), team=job.team)


@router.delete("/{checkpoint_id}/tags/{tag}", response_model=JobCheckpoint, summary="Untag a checkpoint (idempotent)",
               description="Removing a tag the checkpoint does not have changes nothing. Once untagged, retention may "
                           "delete it.",
               responses=_WRITE_ERRORS)
async def untag_checkpoint(job_id: JobId, checkpoint_id: CheckpointId, tag: CheckpointTag,
                           principal: CheckpointWriter, deps: Deps) -> JobCheckpoint:
    store, job = await _writable(deps, job_id, checkpoint_id, principal)
    return await store.shown(await store.untag(checkpoint_id, tag, team=job.team), team=job.team)


@router.delete("/{checkpoint_id}", response_model=JobCheckpoint, summary="Delete a checkpoint (idempotent)",
               description="Marks it deleted and removes its files; answers the record as it is then (`deleted`). "
                           "409 `failed_precondition` for the job's latest checkpoint (a restarting job resumes "
                           "from it), a tagged one (untag it first), one being restored (a restore lease) and one "
                           "still writing. Deleting a deleted checkpoint answers it again.",
               responses=_WRITE_ERRORS)
async def delete_checkpoint(job_id: JobId, checkpoint_id: CheckpointId, principal: CheckpointWriter,
                            deps: Deps) -> JobCheckpoint:
    store, job = await _writable(deps, job_id, checkpoint_id, principal)
    return await store.shown(await store.delete(checkpoint_id, team=job.team), team=job.team)
