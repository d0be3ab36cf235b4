"""/v1/jobs: submit, get, list (and watch), cancel. Callers other than operators see only their team's jobs
(others answer 404); a member cancels only its own jobs, a team admin any of its team's (roles.RULES).

Reads of live jobs are answered from the gateway's read view of them (job_view.py) when it can answer exactly
what the scheduler would, and by the scheduler otherwise; a read after a write through this gateway sees that
write either way (X-Trainyard-Revision: docs/architecture.md, "The gateway's read view")."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Body, Header, Query, Request, Response
from pydantic import Field

from trainyard_core import contract as c
from trainyard_core.errors import InvalidArgument, Unavailable

from .. import job_view_reads, roles, sse
from ..auth import Deps, JobCanceller, JobReader, JobSubmitter, team_scope
from ..clients import WRITE_REVISION
from ..deps import GatewayDeps, deps_of
from ..job_view_events import watch as watch_events
from ..schemas.common import OneOf, error_responses
from ..schemas.jobs import CancelRequest, Job, JobList, JobQuery, JobSubmit
from ..schemas.streams import sse_content
from .params import JobId, Time

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

StateFilter = Annotated[str, OneOf(c.JOB_STATES)]
# key=value: the key by the label rule, the value as a label's value may be.
LabelFilter = Annotated[str, Field(
    pattern="^" + c.LABEL_KEY.pattern[1:-1] + "=[^\\x00]{0," + str(c.MAX_LABEL_VALUE_LENGTH) + "}$")]
INT64_MAX = 2**63 - 1
# A read that must show at least this etcd revision (sent back from a write's or a read's X-Trainyard-Revision).
MinRevision = Annotated[int, Header(
    alias=job_view_reads.REVISION_HEADER, ge=0, le=INT64_MAX,
    description="answer with the jobs as they are at this etcd revision or later: the X-Trainyard-Revision "
                "of an earlier answer (a client of several gateways reads its own writes with it); 0: any")]
# The event ids of the watch are etcd revisions.
EVENT_ID = "^[0-9]{1,19}$"
_EVENT_ID = re.compile(EVENT_ID)


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
    response.headers.update(job_view_reads.revision_headers(WRITE_REVISION.get()))
    return job


@router.get("", response_model=JobList, summary="List jobs, newest first, one page at a time",
            description="Live jobs and finished ones (from the history store, after they have left etcd) in one "
                        "listing, newest submission first. Every filter given must match. Pages are keyset pages: "
                        "a job submitted while you page shows on a fresh first page and never shifts the later "
                        "ones. A `page_token` is only valid with the filters of the page that returned it: another "
                        "one (or a token this API did not hand out) is 422 `invalid_page_token`. "
                        "Callers other than operators see their own team's jobs only (`team` naming another "
                        "team lists nothing)."
                        " With `watch=true` (a query parameter this document leaves out of the list below: its "
                        "answer is a stream that does not end by itself): the changes of the live jobs these "
                        "filters select (`page_size` and "
                        "`page_token` are ignored), as server-sent events (`text/event-stream`): `event: snapshot` "
                        "and every selected job, then an `event: job` per change (the job, with `deleted: true` "
                        "once it has left etcd), each revision's last event with the etcd revision as its `id`; "
                        "reconnect with the `Last-Event-ID` header (or the `last_event_id` query parameter) to "
                        "resume after it. "
                        "A page or a watch is at or after the etcd revision an `X-Trainyard-Revision` header names "
                        "(from an earlier answer), for clients of several gateways (docs/architecture.md, "
                        "\"The gateway's read view\").",
            responses={200: {"content": sse_content(("snapshot", "job"), EVENT_ID,
                                                    "with watch=true: one event (data: the job, plus `deleted`)"),
                             "description": "a page of jobs; with watch=true, the stream of their changes"},
                       **error_responses(400, 401, 403, 422, 429, 503)})
async def list_jobs(
    request: Request,
    principal: JobReader,
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
    # Described in the route's description, not in its parameters: a watch never ends by itself, and a client
    # that reads every answer to its end (the contract test's schemathesis) would wait out each one.
    watch: Annotated[bool, Query(include_in_schema=False)] = False,
    last_event_id: Annotated[str, Query(pattern="^([0-9]{1,19})?$", include_in_schema=False)] = "",
) -> JobList | Response:
    deps = deps_of(request)
    scope = team_scope(principal)
    labels = tuple(sorted({_label_pair(pair) for pair in label or []}))
    # Another team than the caller's, or one label key with two values (no job has both): nothing matches.
    nothing = bool(scope and team and team != scope) or len(dict(labels)) != len(labels)
    query = JobQuery(team=scope or team, user=user, states=tuple(state or []), queue=queue, labels=labels,
                     name_prefix=name_prefix, submitted_after=submitted_after, submitted_before=submitted_before,
                     finished_after=finished_after, finished_before=finished_before)
    # Headers read here rather than declared: a listing answers whatever other headers come with them.
    revision = _revision(request.headers.get(job_view_reads.REVISION_HEADER, ""))
    if watch:
        resume = request.headers.get(sse.LAST_EVENT_ID_HEADER, "") or last_event_id
        if resume and not _EVENT_ID.match(resume):
            raise InvalidArgument(f"{sse.LAST_EVENT_ID_HEADER} must be an event id this watch sent (a revision "
                                  "number), or absent")
        return await _watch(deps, None if nothing else query, resume_after=int(resume) if resume else None)
    if nothing:
        return JobList(jobs=[], next_page_token="")
    if deps.job_view is not None:
        answered = await job_view_reads.list_jobs(deps.job_view, query, page_size=page_size, page_token=page_token,
                                                  revision=revision)
        if answered is not None:
            return answered
    return await deps.scheduler.list_jobs(query, page_size=page_size, page_token=page_token)


def _revision(text: str) -> int:
    if not text:
        return 0
    if not text.isascii() or not text.isdigit() or int(text) > INT64_MAX:
        raise InvalidArgument(f"{job_view_reads.REVISION_HEADER} must be an etcd revision (a number from 0 to "
                              f"{INT64_MAX}) as an earlier answer sent it")
    return int(text)


async def _watch(deps: GatewayDeps, query: JobQuery | None, *, resume_after: int | None) -> Response:
    """The watch of `query` (None: of a filter nothing matches)."""
    flt = job_view_reads.job_filter(query) if query is not None else None
    view = deps.job_view
    if view is None:
        raise Unavailable("this gateway serves no watch: its job_view setting is off")
    if not await view.current():
        raise Unavailable("the watch is not available yet: the gateway's view of the jobs is catching up with "
                          "the scheduler; retry")
    return sse.event_stream(watch_events(view, flt, resume_after))


def _label_pair(text: str) -> tuple[str, str]:
    key, _, value = text.partition("=")
    return key, value


@router.get("/{job_id}", response_model=Job, summary="Get a job",
            responses=error_responses(400, 401, 403, 404, 429, 503))
async def get_job(job_id: JobId, principal: JobReader, request: Request,
                  revision: MinRevision = 0) -> Job | Response:
    deps = deps_of(request)
    team = team_scope(principal)
    if deps.job_view is not None:
        answered = await job_view_reads.get_job(deps.job_view, job_id, team=team, revision=revision)
        if answered is not None:
            return answered
    return await deps.scheduler.get_job(job_id, team=team)


@router.post("/{job_id}:cancel", response_model=Job, summary="Cancel a job (idempotent)",
             description="A pending job is cancelled at once; a running one once its workers are stopped "
                         "(`cancel_requested` is true meanwhile). A member cancels its own jobs; a team admin any "
                         "of its team's (403 for a teammate's job otherwise). The job records who cancelled it "
                         "(`cancelled_by`).",
             responses=error_responses(400, 401, 403, 404, 429, 503))
async def cancel_job(job_id: JobId, principal: JobCanceller, deps: Deps, response: Response,
                     body: Annotated[CancelRequest | None, Body()] = None) -> Job:
    team = team_scope(principal, roles.Action.JOBS_CANCEL)
    job = await deps.scheduler.get_job(job_id, team=team)  # 404 for another team's job
    roles.check_cancel(principal, job.user)
    cancelled = await deps.scheduler.cancel_job(job_id, team=team, user=principal.user,
                                                reason=body.reason if body else "")
    response.headers.update(job_view_reads.revision_headers(WRITE_REVISION.get()))
    return cancelled
