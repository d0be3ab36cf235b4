"""/v1/nodes: the fleet as the scheduler sees it. Any valid token may read it; changing a node's service
state (cordon, GPU health) takes an admin token and is logged with the operator's identity."""

from __future__ import annotations

import logging

from fastapi import APIRouter

from trainyard_core.errors import NotFound

from ..auth import AdminPrincipal, Deps, Principal
from ..schemas.common import error_responses
from ..schemas.nodes import CordonRequest, GpuHealthRequest, Node, NodeList
from .params import GpuIndex, NodeId

router = APIRouter(prefix="/v1/nodes", tags=["nodes"])
log = logging.getLogger(__name__)


@router.get("", response_model=NodeList, summary="List nodes with their GPUs",
            responses=error_responses(401, 503))
async def list_nodes(_: Principal, deps: Deps) -> NodeList:
    return NodeList(nodes=await deps.scheduler.list_nodes())


@router.get("/{node_id}", response_model=Node, summary="One node", responses=error_responses(400, 401, 404, 503))
async def get_node(node_id: NodeId, _: Principal, deps: Deps) -> Node:
    return await deps.scheduler.get_node(node_id)


@router.post("/{node_id}:cordon", response_model=Node, summary="Take a node out of placement (admin)",
             responses=error_responses(400, 401, 403, 404, 503))
async def cordon(node_id: NodeId, principal: AdminPrincipal, deps: Deps, body: CordonRequest | None = None) -> Node:
    reason = (body.reason if body else "") or f"cordoned by {principal.user}"
    node = await deps.scheduler.cordon_node(node_id, cordoned=True, reason=reason)
    log.info("node cordoned", extra={"node_id": node_id, "operator": principal.user, "reason": reason})
    return node


@router.post("/{node_id}:uncordon", response_model=Node, summary="Return a node to placement (admin)",
             responses=error_responses(400, 401, 403, 404, 503))
async def uncordon(node_id: NodeId, principal: AdminPrincipal, deps: Deps) -> Node:
    node = await deps.scheduler.cordon_node(node_id, cordoned=False, reason="")
    log.info("node uncordoned", extra={"node_id": node_id, "operator": principal.user})
    return node


@router.post("/{node_id}/gpus/{gpu_index}:set-health", response_model=Node,
             summary="Mark a GPU healthy again after repair, or unhealthy (admin, audited on the node)",
             responses=error_responses(400, 401, 403, 404, 503))
async def set_gpu_health(node_id: NodeId, gpu_index: GpuIndex, body: GpuHealthRequest, principal: AdminPrincipal,
                         deps: Deps) -> Node:
    node = await deps.scheduler.get_node(node_id)
    if not any(g.index == gpu_index for g in node.gpus):
        raise NotFound(f"node {node_id} has no GPU {gpu_index}")
    await deps.agents.set_gpu_health(node.agent_address, node_id=node.node_id, gpu_index=gpu_index,
                                     healthy=body.healthy, operator=f"{principal.team}/{principal.user}",
                                     reason=body.reason)
    log.info("GPU health set by operator", extra={"node_id": node_id, "gpu": gpu_index, "healthy": body.healthy,
                                                  "operator": principal.user, "reason": body.reason})
    return await deps.scheduler.get_node(node_id)
