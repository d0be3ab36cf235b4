"""/v1/usage: GPU-hours, CPU-hours and cost over a window, grouped by team, project, user, model, queue or job.
A team's tokens (viewer, member, admin) read their own team's use; operators every team's, or one (`team`)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Query

from trainyard_core import contract as c
from trainyard_core.errors import PermissionDenied

from ..auth import Deps, UsageReader, team_scope
from ..roles import Action
from ..schemas.common import error_responses
from ..schemas.usage import GroupBy, UsageReport
from .params import Time

router = APIRouter(prefix="/v1/usage", tags=["usage"])

DEFAULT_WINDOW = timedelta(days=c.DEFAULT_USAGE_WINDOW_DAYS)
_EARLIEST = datetime.min.replace(tzinfo=UTC)


def _window(start: datetime | None, end: datetime | None) -> tuple[datetime, datetime]:
    end = end or datetime.now(UTC)
    if start is None:
        try:
            start = end - DEFAULT_WINDOW
        except OverflowError:  # an end within 30 days of year 1
            start = _EARLIEST
    return start, end


@router.get("", response_model=UsageReport, summary="GPU-hours, CPU-hours and cost, grouped",
            description="Every placed attempt of every job in the window [from, to): finished ones from the "
                        "scheduler's usage records (one per attempt, kept in its history store), running ones "
                        "up to now. An allocation that crosses a boundary of the window counts only with its part "
                        "inside it. Cost is GPU-hours times the price per GPU-hour of their accelerator model "
                        "(the scheduler's usage_prices, in its usage_currency); a model without a price costs 0 and "
                        "is named in `unpriced_models`. Without `to`, the window ends now; without `from`, it "
                        f"starts {c.DEFAULT_USAGE_WINDOW_DAYS} days before its end. A window whose end is not after "
                        "its start holds nothing. Callers other than operators see their own team's use only "
                        "(`team` naming another team is refused with 403).",
            responses=error_responses(400, 401, 403, 429, 503))
async def get_usage(
    principal: UsageReader,
    deps: Deps,
    start: Annotated[Time | None, Query(alias="from", description=(
        f"the window's start, inclusive (RFC 3339, with its time zone); default {c.DEFAULT_USAGE_WINDOW_DAYS} "
        "days before its end"))] = None,
    end: Annotated[Time | None, Query(alias="to", description="the window's end, exclusive; default now")] = None,
    group_by: Annotated[GroupBy, Query(description="what a row is: a team, a project (the jobs' `project` label), "
                                                   "a user, an accelerator model, a queue or a job")] =
        c.DEFAULT_USAGE_GROUP,
    team: Annotated[str, Query(pattern=c.TEAM.or_empty.pattern,
                               description="only this team's use (operators; others may name only their own)")] = "",
    limit: Annotated[int, Query(ge=1, le=c.MAX_USAGE_ROWS, description="the largest groups to list (the totals "
                                                                         "cover every group)")] = c.DEFAULT_USAGE_ROWS,
) -> UsageReport:
    scope = team_scope(principal, Action.USAGE_READ)
    if scope and team and team != scope:
        raise PermissionDenied(f"a token of team {principal.team} may read only that team's usage, not {team}'s")
    start, end = _window(start, end)
    # An inverted window asks the scheduler for the empty window at its start: no rows, zero totals, the currency.
    report = await deps.scheduler.get_usage(since=start, until=max(start, end), group_by=group_by,
                                            team=scope or team, limit=limit)
    return report.model_copy(update={"to": end}) if end < start else report
