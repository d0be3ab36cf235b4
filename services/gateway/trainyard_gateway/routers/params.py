"""Path and query parameters shared by the routers, with the contract's rules in their OpenAPI schema (a
value that breaks them is refused with 400 before any handler runs, and one that follows them is never
refused for its form)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Path

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
