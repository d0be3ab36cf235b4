"""/v1/nodes: the fleet as the scheduler sees it. Any valid token may read it, but only operators see where
the nodes are (hostname and agent address are null for everyone else); changing a node's service state
(cordon, GPU health) is for operators and is logged with the operator's identity."""

from __future__ import annotations

import logging

from fastapi import APIRouter

from trainyard_core.errors import NotFound

from .. import roles
from ..auth import Deps, NodeReader, NodeWriter
from ..schemas.common import error_responses
from ..schemas.nodes import CordonRequest, GpuHealthRequest, Node, NodeList
from ..tokens import TokenRecord
from .params import GpuIndex, NodeId

router = APIRouter(prefix="/v1/nodes", tags=["nodes"])
log = logging.getLogger(__name__)


def _shown(principal: TokenRecord, node: Node) -> Node:
    if roles.allows(principal, roles.Action.NODES_ADDRESSES):
        return node
    return node.model_copy(update={"hostname": None, "agent_address": None})


@router.get("", response_model=NodeList, summary="List nodes with their GPUs",
            responses=error_responses(401, 403, 429, 503))
async def list_nodes(principal: NodeReader, deps: Deps) -> NodeList:
    return NodeList(nodes=[_shown(principal, n) for n in await deps.scheduler.list_nodes()])


@router.get("/{node_id}", response_model=Node, summary="One node",
            responses=error_responses(400, 401, 403, 404, 429, 503))
async def get_node(node_id: NodeId, principal: NodeReader, deps: Deps) -> Node:
    return _shown(principal, await deps.scheduler.get_node(node_id))


@router.post("/{node_id}:cordon", response_model=Node, summary="Take a node out of placement (operator)",
             responses=error_responses(400, 401, 403, 404, 429, 503))
async def cordon(node_id: NodeId, principal: NodeWriter, deps: Deps, body: CordonRequest | None = None) -> Node:
    reason = (body.reason if body else "") or f"cordoned by {principal.user}"
    node = await deps.scheduler.cordon_node(node_id, cordoned=True, reason=reason)
    log.info("node cordoned", extra={"node_id": node_id, "operator": principal.user, "reason": reason})
    return node


@router.post("/{node_id}:uncordon", response_model=Node, summary="Return a node to placement (operator)",
             responses=error_responses(400, 401, 403, 404, 429, 503))
async def uncordon(node_id: NodeId, principal: NodeWriter, deps: Deps) -> Node:
    node = await deps.scheduler.cordon_node(node_id, cordoned=False, reason="")
    log.info("node uncordoned", extra={"node_id": node_id, "operator": principal.user})
    return node


@router.post("/{node_id}/gpus/{gpu_index}:set-health", response_model=Node,
             summary="Mark a GPU healthy again after repair, or unhealthy (operator, audited on the node)",
             responses=error_responses(400, 401, 403, 404, 429, 503))
async def set_gpu_health(node_id: NodeId, gpu_index: GpuIndex, body: GpuHealthRequest, principal: NodeWriter,
                         deps: Deps) -> Node:
    node = await deps.scheduler.get_node(node_id)
    if not any(g.index == gpu_index for g in node.gpus):
        raise NotFound(f"node {node_id} has no GPU {gpu_index}")
    assert node.agent_address is not None  # the scheduler's own view, before any redaction
    await deps.agents.set_gpu_health(node.agent_address, node_id=node.node_id, gpu_index=gpu_index,
                                     healthy=body.healthy, operator=f"{principal.team}/{principal.user}",
                                     reason=body.reason)
    log.info("GPU health set by operator", extra={"node_id": node_id, "gpu": gpu_index, "healthy": body.healthy,
                                                  "operator": principal.user, "reason": body.reason})
    return await deps.scheduler.get_node(node_id)
