"""/v1/jobs: submit, get, list, cancel, logs. Callers other than operators see only their team's jobs (others
answer 404); a member cancels only its own jobs, a team admin any of its team's (roles.RULES)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Header, Query, Response
from fastapi.responses import PlainTextResponse
from pydantic import Field

from trainyard_core import contract as c

from .. import roles
from ..auth import Deps, JobCanceller, JobReader, JobSubmitter, team_scope
from ..joblogs import job_logs
from ..schemas.common import OneOf, error_responses
from ..schemas.jobs import CancelRequest, Job, JobList, JobQuery, JobSubmit
from .params import JobId, Time

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

StateFilter = Annotated[str, OneOf(c.JOB_STATES)]
# key=value: the key by the label rule, the value as a label's value may be.
LabelFilter = Annotated[str, Field(
    pattern="^" + c.LABEL_KEY.pattern[1:-1] + "=[^\\x00]{0," + str(c.MAX_LABEL_VALUE_LENGTH) + "}$")]


@router.post("", status_code=201, response_model=Job, summary="Submit a job",
             description="201 with the new job. With an `Idempotency-Key`, a retry of the same request (the same "
                         "body, by the same user) within 24 hours answers 200 with the job the first one created; "
                         "the key with another body is refused with 422 `idempotency_key_reused`. 409 "
                         "`failed_precondition` when the spec is valid but this cluster cannot run it as "
                         "it is: more nodes or GPUs per node than the fleet has, an accelerator no node has, a "
                         "queue or priority class that does not exist.",
             responses={200: {"model": Job, "description": "a retry: the job the first submit with this "
                                                            "Idempotency-Key created"},
                        **error_responses(400, 401, 403, 409, 422, 429, 503, 507)})
async def submit_job(
    spec: JobSubmit,
    principal: JobSubmitter,
    deps: Deps,
    response: Response,
    idempotency_key: Annotated[str | None, Header(
        alias="Idempotency-Key", pattern=c.IDEMPOTENCY_KEY.pattern,
        description="retrying a submit with the same key (and the same body) returns the first job instead of "
                    f"a new one ({c.IDEMPOTENCY_KEY.rule})")] = None,
) -> Job:
    job, created = await deps.scheduler.submit_job(spec, team=principal.team, user=principal.user,
                                                   idempotency_key=idempotency_key or "")
    if not created:
        response.status_code = 200
    return job


@router.get("", response_model=JobList, summary="List jobs, newest first, one page at a time",
            description="Live jobs and finished ones (from the history store, after they have left etcd) in one "
                        "listing, newest submission first. Every filter given must match. Pages are keyset pages: "
                        "a job submitted while you page shows on a fresh first page and never shifts the later "
                        "ones. A `page_token` is only valid with the filters of the page that returned it: another "
                        "one (or a token this API did not hand out) is 422 `invalid_page_token`. "
                        "Callers other than operators see their own team's jobs only (`team` naming another "
                        "team lists nothing).",
            responses=error_responses(400, 401, 403, 422, 429, 503))
async def list_jobs(
    principal: JobReader,
    deps: Deps,
    page_size: Annotated[int, Query(ge=1, le=c.MAX_PAGE_SIZE, description="jobs per page")] = c.DEFAULT_PAGE_SIZE,
    page_token: Annotated[str, Query(pattern=c.PAGE_TOKEN.or_empty.pattern,
                                     description="next_page_token of the previous page")] = "",
    state: Annotated[list[StateFilter] | None, Query(description="only jobs in these states (repeatable)")] = None,
    team: Annotated[str, Query(pattern=c.TEAM.or_empty.pattern, description="only this team's jobs")] = "",
    user: Annotated[str, Query(pattern=c.USER.or_empty.pattern, description="only jobs this user submitted")] = "",
    queue: Annotated[str, Query(pattern=c.QUEUE_NAME.or_empty.pattern, description="only this queue's jobs")] = "",
    label: Annotated[list[LabelFilter] | None, Query(
        max_length=c.MAX_LABELS,
        description="only jobs with this label, as key=value (repeatable: every one must match)")] = None,
    name_prefix: Annotated[str, Query(max_length=c.MAX_JOB_NAME_LENGTH, pattern=c.NO_NUL.pattern,
                                      description="only jobs whose name starts with this")] = "",
    submitted_after: Annotated[Time | None, Query(
        description="only jobs submitted at or after this time (RFC 3339, with a time zone)")] = None,
    submitted_before: Annotated[Time | None, Query(
        description="only jobs submitted before this time")] = None,
    finished_after: Annotated[Time | None, Query(
        description="only jobs that finished at or after this time (running jobs never match)")] = None,
    finished_before: Annotated[Time | None, Query(
        description="only jobs that finished before this time")] = None,
) -> JobList:
    scope = team_scope(principal)
    if scope and team and team != scope:
        return JobList(jobs=[], next_page_token="")
    labels = tuple(sorted({_label_pair(pair) for pair in label or []}))
    if len(dict(labels)) != len(labels):  # one key with two values: no job has both
        return JobList(jobs=[], next_page_token="")
    query = JobQuery(team=scope or team, user=user, states=tuple(state or []), queue=queue, labels=labels,
                     name_prefix=name_prefix, submitted_after=submitted_after, submitted_before=submitted_before,
                     finished_after=finished_after, finished_before=finished_before)
    return await deps.scheduler.list_jobs(query, page_size=page_size, page_token=page_token)


def _label_pair(text: str) -> tuple[str, str]:
    key, _, value = text.partition("=")
    return key, value


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
