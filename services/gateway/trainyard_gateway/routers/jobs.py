"""/v1/jobs: submit, get, list, cancel, logs. Non-admin callers see only their team's jobs."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Body, Header, Query
from fastapi.responses import PlainTextResponse

from trainyard_core.errors import InvalidArgument
from trainyard_core.ids import is_valid_id

from ..auth import Deps, Principal, team_scope
from ..joblogs import job_logs
from ..schemas.common import error_responses
from ..schemas.jobs import CancelRequest, Job, JobList, JobSubmit

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

StateFilter = Literal["pending", "admitted", "running", "succeeded", "failed", "cancelled", "preempted",
                      "restarting"]


def _checked_id(job_id: str) -> str:
    if not is_valid_id(job_id):
        raise InvalidArgument(f"{job_id[:80]!r} is not a valid job id (3-63 lower-case letters, digits "
                              "and '-', starting with a letter)")
    return job_id


@router.post("", status_code=201, response_model=Job, summary="Submit a job",
             responses=error_responses(400, 401, 409, 429, 503))
async def submit_job(
    spec: JobSubmit,
    principal: Principal,
    deps: Deps,
    idempotency_key: Annotated[str | None, Header(
        alias="Idempotency-Key", max_length=128,
        description="retrying a submit with the same key returns the first job instead of a new one")] = None,
) -> Job:
    return await deps.scheduler.submit_job(spec, team=principal.team, user=principal.user,
                                           idempotency_key=idempotency_key or "")


@router.get("", response_model=JobList, summary="List jobs, oldest first, one page at a time",
            responses=error_responses(400, 401, 503))
async def list_jobs(
    principal: Principal,
    deps: Deps,
    page_size: Annotated[int, Query(ge=1, le=500, description="jobs per page")] = 50,
    page_token: Annotated[str, Query(max_length=1024, description="next_page_token of the previous page")] = "",
    state: Annotated[list[StateFilter] | None, Query(description="only jobs in these states (repeatable)")] = None,
) -> JobList:
    return await deps.scheduler.list_jobs(page_size=page_size, page_token=page_token,
                                          team=team_scope(principal), states=state or [])


@router.get("/{job_id}", response_model=Job, summary="Get a job", responses=error_responses(400, 401, 404, 503))
async def get_job(job_id: str, principal: Principal, deps: Deps) -> Job:
    return await deps.scheduler.get_job(_checked_id(job_id), team=team_scope(principal))


@router.post("/{job_id}:cancel", response_model=Job, summary="Cancel a job (idempotent)",
             description="A pending job is cancelled at once; a running one once its workers are stopped "
                         "(`cancel_requested` is true meanwhile).",
             responses=error_responses(400, 401, 404, 503))
async def cancel_job(job_id: str, principal: Principal, deps: Deps,
                     body: Annotated[CancelRequest | None, Body()] = None) -> Job:
    return await deps.scheduler.cancel_job(_checked_id(job_id), team=team_scope(principal),
                                           reason=body.reason if body else "")


@router.get("/{job_id}/logs", response_class=PlainTextResponse, summary="Logs of every rank of a job",
            description="Plain text, one line per output line, each prefixed with its rank (`[rank 0] ...`), "
                        "ordered by rank. Nodes that cannot be reached are named in trailing `[gateway]` lines.",
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                             "description": "the merged logs"}, **error_responses(400, 401, 404, 503)})
async def get_job_logs(
    job_id: str,
    principal: Principal,
    deps: Deps,
    tail: Annotated[int, Query(ge=0, le=1_000_000, description="last N lines of each rank; 0 for all")] = 0,
    attempt: Annotated[int | None, Query(ge=0, description="attempt to show; default the current one, "
                                                           "0 for every attempt")] = None,
) -> PlainTextResponse:
    text = await job_logs(deps.scheduler, deps.agents, job_id=_checked_id(job_id), team=team_scope(principal),
                          tail_lines=tail, attempt=attempt, max_lines=deps.settings.max_log_lines)
    return PlainTextResponse(text)
