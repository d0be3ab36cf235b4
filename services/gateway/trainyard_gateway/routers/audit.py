"""/v1/audit: the audit log of every service, newest first, for cluster operators (the scheduler's AuditService:
the entries in etcd not moved yet, merged with the history store's)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query

from trainyard_core import audit
from trainyard_core import contract as c

from ..auth import Deps, OperatorPrincipal
from ..schemas.audit import AuditEntry, AuditPage
from ..schemas.common import error_responses
from .params import Time

router = APIRouter(prefix="/v1/audit", tags=["audit"])

_TEXT = {"max_length": audit.MAX_FIELD, "pattern": r"^[ -~]*$"}


def _epoch(value: datetime | None) -> float | None:
    return None if value is None else value.timestamp()


def to_schema(e: audit.AuditEntry) -> AuditEntry:
    return AuditEntry(id=e.id, time=datetime.fromtimestamp(e.time, UTC), principal=e.principal, role=e.role,
                      service=e.service, action=e.action, target=e.target, team=e.team, result=e.result,
                      message=e.message, request_id=e.request_id, detail=dict(e.detail))


@router.get("", response_model=AuditPage, summary="The audit log, newest first (operators)",
            description="Every mutating call on every service that keeps state: the gateway's HTTP API, "
                        "its TokenService, the scheduler, the checkpoint-store. Filters combine (all must match).",
            responses=error_responses(400, 401, 403, 429, 503))
async def list_audit(
    _: OperatorPrincipal,
    deps: Deps,
    principal: Annotated[str, Query(description="exactly this principal: user:<team>/<user>, "
                                                "trainyard://..., anonymous", **_TEXT)] = "",
    user: Annotated[str, Query(pattern=c.USER.or_empty.pattern, description="a gateway user, in any team")] = "",
    team: Annotated[str, Query(pattern=c.TEAM.or_empty.pattern, description="the team acted for")] = "",
    action: Annotated[str, Query(description="the whole action, or its last part (CancelJob)", **_TEXT)] = "",
    target: Annotated[str, Query(description="exactly this target, e.g. job/j-...", **_TEXT)] = "",
    result: Annotated[str, Query(description="ok, or an error code", max_length=64,
                                 pattern=r"^[a-z0-9_]*$")] = "",
    request_id: Annotated[str, Query(pattern=audit.REQUEST_ID.or_empty.pattern,
                                     description="every service's entries of one request (its X-Request-Id)")] = "",
    since: Annotated[Time | None, Query(description="only entries at or after this time (RFC 3339, with its "
                                                    "time zone)")] = None,
    until: Annotated[Time | None, Query(description="only entries at or before this time")] = None,
    page_size: Annotated[int, Query(ge=1, le=c.MAX_PAGE_SIZE, description="entries per page")] = c.DEFAULT_PAGE_SIZE,
    page_token: Annotated[str, Query(pattern=audit.PAGE_TOKEN.or_empty.pattern,
                                     description="next_page_token of the previous page")] = "",
) -> AuditPage:
    flt = audit.AuditFilter(principal=principal, user=user, team=team, action=action, target=target,
                            result=result, request_id=request_id, since=_epoch(since), until=_epoch(until))
    if flt.since is not None and flt.until is not None and flt.since > flt.until:
        return AuditPage(entries=[], next_page_token="")  # a well-formed window that nothing falls into
    page = await deps.scheduler.list_audit(flt, page_size=page_size, page_token=page_token)
    return AuditPage(entries=[to_schema(e) for e in page.entries], next_page_token=page.next_page_token)
