"""/v1/pending: the queue in order, as the leader's last scheduling cycle considered it, with why each job waits
(Slurm's `squeue --state=PD` with its Reason column). A team's tokens see their own team's jobs (their places
still count every team's jobs ahead); operators every team's, or one (`team`)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from trainyard_core import contract as c
from trainyard_core.errors import PermissionDenied

from ..auth import Deps, JobReader, team_scope
from ..schemas.common import error_responses
from ..schemas.pending import PendingList

router = APIRouter(prefix="/v1/pending", tags=["jobs"])


@router.get("", response_model=PendingList, summary="Pending jobs in queue order, with why each waits",
            description="The pending jobs in the order the scheduler's last cycle considered them, which is the "
                        "order they would be placed in as things stand (queue tier, priority class, priority, then "
                        "fair share and submission time). `position` is a job's 1-based place in its queue; held "
                        "jobs follow with position 0. Places are as of `as_of` and move as other jobs are placed, "
                        "submitted or held; a job submitted after that cycle is not listed until the next one "
                        "(which its submit starts).",
            responses=error_responses(400, 401, 403, 429, 503))
async def list_pending(
    principal: JobReader,
    deps: Deps,
    queue: Annotated[str, Query(pattern=c.QUEUE_NAME.or_empty.pattern, description="only this queue's jobs")] = "",
    job_id: Annotated[str, Query(pattern=c.ID.or_empty.pattern, description="only this job")] = "",
    team: Annotated[str, Query(pattern=c.TEAM.or_empty.pattern,
                               description="only this team's jobs (operators; others may name only their own)")] = "",
    limit: Annotated[int, Query(ge=1, le=c.MAX_PENDING_ROWS, description="at most this many jobs, the first in "
                                                                          "order (`total` counts all)")] =
        c.DEFAULT_PENDING_ROWS,
) -> PendingList:
    scope = team_scope(principal)
    if scope and team and team != scope:
        raise PermissionDenied(f"a token of team {principal.team} may list only that team's jobs, not {team}'s")
    return await deps.scheduler.list_pending(team=scope or team, queue=queue, job_id=job_id, limit=limit)
