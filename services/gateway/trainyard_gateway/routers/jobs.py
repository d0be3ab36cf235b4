"""/v1/jobs: submit, get, list, cancel, logs. Callers other than operators see only their team's jobs (others
answer 404); a member cancels only its own jobs, a team admin any of its team's (roles.RULES)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Header, Query, Response
from fastapi.responses import PlainTextResponse

from trainyard_core import contract as c

from .. import roles
from ..auth import Deps, JobCanceller, JobReader, JobSubmitter, team_scope
from ..joblogs import job_logs
from ..schemas.common import OneOf, error_responses
from ..schemas.jobs import CancelRequest, Job, JobList, JobSubmit
from .params import JobId

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

StateFilter = Annotated[str, OneOf(c.JOB_STATES)]


@router.post("", status_code=201, response_model=Job, summary="Submit a job",
             description="409 `failed_precondition` when the spec is valid but this cluster cannot run it as "
                         "it is: more nodes or GPUs per node than the fleet has, an accelerator no node has, a "
                         "queue or priority class that does not exist.",
             responses=error_responses(400, 401, 403, 409, 429, 503))
async def submit_job(
    spec: JobSubmit,
    principal: JobSubmitter,
    deps: Deps,
    idempotency_key: Annotated[str | None, Header(
        alias="Idempotency-Key", pattern=c.IDEMPOTENCY_KEY.pattern,
        description="retrying a submit with the same key returns the first job instead of a new one "
                    f"({c.IDEMPOTENCY_KEY.rule})")] = None,
) -> Job:
    return await deps.scheduler.submit_job(spec, team=principal.team, user=principal.user,
                                           idempotency_key=idempotency_key or "")


@router.get("", response_model=JobList, summary="List jobs, oldest first, one page at a time",
            responses=error_responses(400, 401, 403, 429, 503))
async def list_jobs(
    principal: JobReader,
    deps: Deps,
    page_size: Annotated[int, Query(ge=1, le=c.MAX_PAGE_SIZE, description="jobs per page")] = c.DEFAULT_PAGE_SIZE,
    page_token: Annotated[str, Query(pattern=c.ID.or_empty.pattern,
                                     description="next_page_token of the previous page")] = "",
    state: Annotated[list[StateFilter] | None, Query(description="only jobs in these states (repeatable)")] = None,
) -> JobList:
    return await deps.scheduler.list_jobs(page_size=page_size, page_token=page_token,
                                          team=team_scope(principal), states=state or [])


@router.get("/{job_id}", response_model=Job, summary="Get a job",
            responses=error_responses(400, 401, 403, 404, 429, 503))
async def get_job(job_id: JobId, principal: JobReader, deps: Deps) -> Job:
    return await deps.scheduler.get_job(job_id, team=team_scope(principal))


@router.post("/{job_id}:cancel", response_model=Job, summary="Cancel a job (idempotent)",
             description="A pending job is cancelled at once; a running one once its workers are stopped "
                         "(`cancel_requested` is true meanwhile). A member cancels its own jobs; a team admin any "
                         "of its team's (403 for a teammate's job otherwise). The job records who cancelled it "
                         "(`cancelled_by`).",
             responses=error_responses(400, 401, 403, 404, 429, 503))
async def cancel_job(job_id: JobId, principal: JobCanceller, deps: Deps,
                     body: Annotated[CancelRequest | None, Body()] = None) -> Job:
    team = team_scope(principal, roles.Action.JOBS_CANCEL)
    job = await deps.scheduler.get_job(job_id, team=team)  # 404 for another team's job
    roles.check_cancel(principal, job.user)
    return await deps.scheduler.cancel_job(job_id, team=team, user=principal.user,
                                           reason=body.reason if body else "")


# response_class Response (no media type of its own): the error bodies are then documented as the JSON they
# are, and 200 as text/plain below. With PlainTextResponse here, FastAPI documents every response as text.
@router.get("/{job_id}/logs", response_class=Response, summary="Logs of every rank of a job",
            description="Plain text, one line per output line, each prefixed with its rank (`[rank 0] ...`), "
                        "ordered by rank. Nodes that cannot be reached are named in trailing `[gateway]` lines.",
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                             "description": "the merged logs"}, **error_responses(400, 401, 403, 404, 429, 503)})
async def get_job_logs(
    job_id: JobId,
    principal: JobReader,
    deps: Deps,
    tail: Annotated[int, Query(ge=0, le=c.MAX_LOG_TAIL, description="last N lines of each rank; 0 for all")] = 0,
    attempt: Annotated[int | None, Query(ge=0, le=c.INT32_MAX, description="attempt to show; default the current "
                                                                           "one, 0 for every attempt")] = None,
) -> PlainTextResponse:
    text = await job_logs(deps.scheduler, deps.agents, job_id=job_id, team=team_scope(principal),
                          tail_lines=tail, attempt=attempt, max_lines=deps.settings.max_log_lines,
                          show_addresses=roles.allows(principal, roles.Action.NODES_ADDRESSES))
    return PlainTextResponse(text)
