"""UsageService: GPU-hours, CPU-hours and cost over a window (usage_report.py gathers, domain/usage.py adds up).
Any replica answers."""

from __future__ import annotations

from collections.abc import Mapping

import grpc.aio

from trainyard.scheduler.v1 import usage_pb2, usage_pb2_grpc
from trainyard_core import contract as c
from trainyard_core.errors import InvalidArgument

from ..domain.usage import check_group_by
from ..domain.validation import validate_team
from ..usage_report import UsageReader
from . import usage_convert
from .teams import acting_team


class UsageServicer(usage_pb2_grpc.UsageServiceServicer):
    def __init__(self, reader: UsageReader, *, tool_teams: Mapping[str, frozenset[str]] | None = None) -> None:
        self._reader = reader
        self._tool_teams = dict(tool_teams or {})

    async def GetUsage(self, request: usage_pb2.GetUsageRequest,
                       context: grpc.aio.ServicerContext) -> usage_pb2.GetUsageResponse:
        team = acting_team(request.team, self._tool_teams)
        if team:
            validate_team(team)
        window = usage_convert.window_from_pb(request)
        group_by = check_group_by(request.group_by)
        limit = request.limit or c.DEFAULT_USAGE_ROWS
        if not 1 <= limit <= c.MAX_USAGE_ROWS:
            raise InvalidArgument(f"limit must be from 1 to {c.MAX_USAGE_ROWS} (or 0 for {c.DEFAULT_USAGE_ROWS}), "
                                  f"not {request.limit}")
        report, now = await self._reader.report(window, group_by, team=team)
        return usage_convert.report_to_pb(report, limit=limit, computed_at=now, pricing=self._reader.pricing)
