"""Path and query parameters shared by the routers, with the contract's rules in their OpenAPI schema (a
value that breaks them is refused with 400 before any handler runs, and one that follows them is never
refused for its form)."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated

from fastapi import Path
from pydantic import BeforeValidator

from trainyard_core import contract as c

JobId = Annotated[str, Path(pattern=c.ID.pattern, description=f"a job id: {c.ID.rule}",
                            examples=["job-01m8rd01bvcpnb6077"])]
NodeId = Annotated[str, Path(pattern=c.ID.pattern, description=f"a node id: {c.ID.rule}", examples=["node-1"])]
TokenId = Annotated[str, Path(pattern=c.ID.pattern, description=f"a token id: {c.ID.rule}",
                              examples=["tok-01m8rd01bvcpnb6077"])]
QueueName = Annotated[str, Path(pattern=c.QUEUE_NAME.pattern, description=f"a queue name: {c.QUEUE_NAME.rule}",
                                examples=["research"])]
Team = Annotated[str, Path(pattern=c.TEAM.pattern, description=f"a team: {c.TEAM.rule}", examples=["vision"])]
# Parameters arrive as text, so numbers are parsed from it (not the strict Int of request bodies).
GpuIndex = Annotated[int, Path(ge=0, le=c.INT32_MAX, description="the GPU's index on its node")]
CheckpointId = Annotated[str, Path(pattern=c.CHECKPOINT_ID.pattern,
                                   description=f"a checkpoint id: {c.CHECKPOINT_ID.rule}",
                                   examples=["ckpt-01m8rd01bvcpnb6077"])]
CheckpointTag = Annotated[str, Path(pattern=c.CHECKPOINT_TAG.pattern, description=f"a tag: {c.CHECKPOINT_TAG.rule}",
                                    examples=["best"])]

_RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d{1,9})?([Zz]|[+-]\d{2}:\d{2})$")


def _rfc3339(value: object) -> object:
    # The schema says date-time (RFC 3339): a time zone is part of it, and a bare number is not one.
    if isinstance(value, str) and not _RFC3339.match(value):
        raise ValueError("must be an RFC 3339 time with its time zone, e.g. 2026-01-31T12:00:00Z")
    return value


# A time in a query (GET /v1/audit's since/until, GET /v1/usage's from/to): RFC 3339 with its time zone.
Time = Annotated[datetime, BeforeValidator(_rfc3339)]
