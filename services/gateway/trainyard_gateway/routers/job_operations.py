"""/v1/jobs/{id}: the operations beside submit and cancel — hold, release, requeue, priority change (PATCH) and
resubmit. Team-scoped like cancel: another team's job answers 404; a member acts on its own jobs, a team admin
on any of its team's (403 for a teammate's job otherwise; roles.check_update), operators on every team's. A
resubmit needs only to see the job and to submit (it creates a new job as the caller). The scheduler records
who did what in the job's events (and both services in the audit log)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Header, Response

from trainyard_core import contract as c

from .. import roles
from ..auth import Deps, JobSubmitter, JobUpdater, team_scope
from ..resubmit import resubmitted_spec
from ..schemas.common import error_responses
from ..schemas.job_operations import HoldRequest, JobUpdate, RequeueRequest, ResubmitRequest
from ..schemas.jobs import Job
from ..tokens import TokenRecord
from .params import JobId

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

_STATE_ERRORS = error_responses(400, 401, 403, 404, 409, 429, 503)


async def _own(deps: Deps, principal: TokenRecord, job_id: str, verb: str) -> tuple[Job, str]:
    """The job (404 for another team's) once the caller may `verb` it, and the team filter to pass on."""
    team = team_scope(principal, roles.Action.JOBS_UPDATE)
    job = await deps.scheduler.get_job(job_id, team=team)
    roles.check_update(principal, job.user, verb)
    return job, team


@router.post("/{job_id}:hold", response_model=Job, summary="Hold a pending job (idempotent)",
             description="The job stays pending, in its place in the queue, but is not placed until it is released "
                         "(`held_by`, `hold_reason`; its `message` says so). 409 `failed_precondition` for a job "
                         "that is not pending: a placed job can be requeued first.",
             responses=_STATE_ERRORS)
async def hold_job(job_id: JobId, principal: JobUpdater, deps: Deps,
                   body: Annotated[HoldRequest | None, Body()] = None) -> Job:
    _, team = await _own(deps, principal, job_id, "hold")
    return await deps.scheduler.hold_job(job_id, team=team, user=principal.user, reason=body.reason if body else "")


@router.post("/{job_id}:release", response_model=Job, summary="Release a held job (idempotent)",
             description="The job is placed again as any pending job, from its original place in the queue "
                         "(`queued_at` unchanged). A hold is lifted by whoever placed it or by a team admin (403 "
                         "otherwise). Releasing a pending job that is not held changes nothing; 409 "
                         "`failed_precondition` for a job that is not pending.",
             responses=_STATE_ERRORS)
async def release_job(job_id: JobId, principal: JobUpdater, deps: Deps) -> Job:
    team = team_scope(principal, roles.Action.JOBS_UPDATE)
    job = await deps.scheduler.get_job(job_id, team=team)
    roles.check_release(principal, job.user, job.held_by)
    return await deps.scheduler.release_job(job_id, team=team, user=principal.user)


@router.post("/{job_id}:requeue", response_model=Job, summary="Requeue a running job (idempotent)",
             description="The job's workers are stopped as in a preemption (its `preemption.signal`, then SIGKILL "
                         "after its `preemption.grace_s`) and the job goes back to pending as a new attempt, counted "
                         "against no restart budget; `requeue_requested_by` names who asked until the workers are "
                         "stopped. 409 `failed_precondition` for a job that is not admitted or running.",
             responses=_STATE_ERRORS)
async def requeue_job(job_id: JobId, principal: JobUpdater, deps: Deps,
                      body: Annotated[RequeueRequest | None, Body()] = None) -> Job:
    _, team = await _own(deps, principal, job_id, "requeue")
    return await deps.scheduler.requeue_job(job_id, team=team, user=principal.user,
                                            reason=body.reason if body else "")


@router.patch("/{job_id}", response_model=Job, summary="Change a job's priority",
              description="Any job that has not finished (409 `failed_precondition` otherwise). The scheduler uses "
                          "the new priority from its next cycle, for placement and for preemption (a raised pending "
                          "job may preempt; a lowered running one may be preempted). A member may set any priority "
                          "the submit allows on its own jobs; a team admin on any of its team's.",
              responses=_STATE_ERRORS)
async def update_job(job_id: JobId, body: JobUpdate, principal: JobUpdater, deps: Deps) -> Job:
    _, team = await _own(deps, principal, job_id, "change the priority of")
    return await deps.scheduler.set_job_priority(job_id, team=team, user=principal.user, priority=body.priority)


@router.post("/{job_id}:resubmit", status_code=201, response_model=Job, summary="Resubmit a job with changes",
             description="A new job, submitted as the caller, from the spec of this one (any state, also a finished "
                         "job that has left etcd for the history store) with `overrides` merged in; its "
                         f"`{c.RESUBMITTED_FROM_LABEL}` label names this job. A job read from the history store "
                         "keeps its environment's names, not their values: give them again in `overrides.env`. "
                         "`Idempotency-Key` as for a submit. 409 `failed_precondition` when the overrides do not "
                         "make a valid job with this job's spec (the message names the field) or the cluster cannot "
                         "run it.",
             responses={200: {"model": Job, "description": "a retry: the job the first resubmit with this "
                                                            "Idempotency-Key created"},
                        **error_responses(400, 401, 403, 404, 409, 422, 429, 503, 507)})
async def resubmit_job(
    job_id: JobId,
    principal: JobSubmitter,
    deps: Deps,
    response: Response,
    body: Annotated[ResubmitRequest | None, Body()] = None,
    idempotency_key: Annotated[str | None, Header(
        alias="Idempotency-Key", pattern=c.IDEMPOTENCY_KEY.pattern,
        description="retrying a resubmit with the same key (and the same body) returns the first job "
                    f"({c.IDEMPOTENCY_KEY.rule})")] = None,
) -> Job:
    source = await deps.scheduler.get_job(job_id, team=team_scope(principal))
    overrides = body.overrides.model_dump(exclude_unset=True) if body else {}
    job, created = await deps.scheduler.submit_job(resubmitted_spec(source, overrides), team=principal.team,
                                                   user=principal.user, idempotency_key=idempotency_key or "")
    if not created:
        response.status_code = 200
    return job
