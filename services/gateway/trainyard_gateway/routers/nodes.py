"""/v1/nodes: the fleet as the scheduler sees it. Any valid token may read it."""

from __future__ import annotations

from fastapi import APIRouter

from ..auth import Deps, Principal
from ..schemas.common import error_responses
from ..schemas.nodes import NodeList

router = APIRouter(prefix="/v1/nodes", tags=["nodes"])


@router.get("", response_model=NodeList, summary="List nodes with their GPUs",
            responses=error_responses(401, 503))
async def list_nodes(_: Principal, deps: Deps) -> NodeList:
    return NodeList(nodes=await deps.scheduler.list_nodes())
