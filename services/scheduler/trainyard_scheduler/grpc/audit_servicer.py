"""AuditService: the audit log of every service, newest first (audit_archive.AuditReader merges etcd's part with
the history store's). Any replica answers; the authorization table lets only the gateway call it (its
operators' GET /v1/audit)."""

from __future__ import annotations

import grpc.aio

from trainyard.scheduler.v1 import audit_pb2, audit_pb2_grpc
from trainyard_core import audit
from trainyard_core import contract as c
from trainyard_core.errors import InvalidArgument

from ..audit_archive import AuditReader
from .usage_convert import seconds_of, timestamp_of

_TEXT_FIELDS = ("principal", "user", "team", "action", "target", "result", "request_id")


def filter_from_pb(request: audit_pb2.ListAuditEntriesRequest) -> audit.AuditFilter:
    for name in _TEXT_FIELDS:
        if len(getattr(request, name)) > audit.MAX_FIELD:
            raise InvalidArgument(f"{name} must be at most {audit.MAX_FIELD} characters")
    return audit.AuditFilter(
        **{name: getattr(request, name) for name in _TEXT_FIELDS},
        since=seconds_of(request.since) if request.HasField("since") else None,
        until=seconds_of(request.until) if request.HasField("until") else None)


def entry_to_pb(e: audit.AuditEntry) -> audit_pb2.AuditEntry:
    return audit_pb2.AuditEntry(id=e.id, time=timestamp_of(e.time), principal=e.principal, role=e.role,
                                service=e.service, action=e.action, target=e.target, team=e.team, result=e.result,
                                message=e.message, request_id=e.request_id, detail=dict(e.detail))


class AuditServicer(audit_pb2_grpc.AuditServiceServicer):
    def __init__(self, reader: AuditReader) -> None:
        self._reader = reader

    async def ListAuditEntries(self, request: audit_pb2.ListAuditEntriesRequest,
                               context: grpc.aio.ServicerContext) -> audit_pb2.ListAuditEntriesResponse:
        flt = filter_from_pb(request)
        page_size = request.page_size or c.DEFAULT_PAGE_SIZE
        if not 1 <= page_size <= c.MAX_PAGE_SIZE:
            raise InvalidArgument(f"page_size must be 1-{c.MAX_PAGE_SIZE} (or 0 for {c.DEFAULT_PAGE_SIZE}), "
                                  f"not {request.page_size}")
        if flt.since is not None and flt.until is not None and flt.since > flt.until:
            return audit_pb2.ListAuditEntriesResponse()  # a well-formed window nothing falls into
        page = await self._reader.query(flt, page_size=page_size, page_token=request.page_token)
        return audit_pb2.ListAuditEntriesResponse(entries=[entry_to_pb(e) for e in page.entries],
                                                  next_page_token=page.next_page_token)
