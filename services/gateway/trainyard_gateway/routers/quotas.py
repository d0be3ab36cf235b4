"""/v1/quotas: team quotas. Operators set them and read every team's; any other token (a team admin too)
reads only its own team's quota. Changes are logged with the operator's identity."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Response

from trainyard_core.errors import PermissionDenied

from .. import roles
from ..auth import Deps, QuotaReader, QuotaWriter, team_scope
from ..schemas.common import error_responses
from ..schemas.quotas import Quota, QuotaList, QuotaPut
from ..tokens import TokenRecord
from .params import Team

router = APIRouter(prefix="/v1/quotas", tags=["quotas"])
log = logging.getLogger(__name__)


def _may_read(principal: TokenRecord, team: str) -> None:
    if not roles.sees_team(principal, roles.Action.QUOTAS_READ, team):
        raise PermissionDenied(f"a token of team {principal.team} may read only that team's quota, not {team}'s")


@router.get("", response_model=QuotaList, summary="List quotas (operators: every team; others: their own team)",
            responses=error_responses(401, 403, 429, 503))
async def list_quotas(principal: QuotaReader, deps: Deps) -> QuotaList:
    return QuotaList(quotas=await deps.scheduler.list_quotas(team=team_scope(principal, roles.Action.QUOTAS_READ)))


@router.get("/{team}", response_model=Quota, summary="One team's quota (operator, or a token of that team)",
            responses=error_responses(400, 401, 403, 404, 429, 503))
async def get_quota(team: Team, principal: QuotaReader, deps: Deps) -> Quota:
    _may_read(principal, team)
    return await deps.scheduler.get_quota(team)


@router.put("/{team}", response_model=Quota, summary="Create or replace a team's quota (operator)",
            description="Answers 201 when the quota was created, 200 when an existing one was replaced.",
            responses={201: {"model": Quota, "description": "Created"},
                       **error_responses(400, 401, 403, 409, 429, 503)})
async def put_quota(team: Team, body: QuotaPut, principal: QuotaWriter, deps: Deps, response: Response) -> Quota:
    quota, created = await deps.scheduler.put_quota(team, body)
    response.status_code = 201 if created else 200
    log.info("quota stored", extra={"team": team, "was_created": created, "operator": principal.user})
    return quota


@router.delete("/{team}", response_model=Quota, summary="Delete a team's quota (operator)",
               responses=error_responses(400, 401, 403, 404, 409, 429, 503))
async def delete_quota(team: Team, principal: QuotaWriter, deps: Deps) -> Quota:
    quota = await deps.scheduler.delete_quota(team)
    log.info("quota deleted", extra={"team": team, "operator": principal.user})
    return quota
