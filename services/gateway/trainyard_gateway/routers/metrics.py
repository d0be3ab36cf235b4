"""/v1/nodes/{id}/metrics and /v1/fleet/metrics: GPU telemetry over time, what the web console charts without a
Prometheus server (design: fleet_metrics.py, and the agent's gpu_history.py). Any token that may read nodes may
read them; only operators see agent addresses in the messages about agents that do not answer."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query

from trainyard_core.errors import FailedPrecondition, TrainyardError, Unavailable

from .. import convert, roles
from ..auth import Deps, NodeReader
from ..joblogs import failure
from ..schemas.common import error_responses
from ..schemas.metrics import FleetMetrics, NodeMetrics
from .params import NodeId

router = APIRouter(tags=["nodes"])

MAX_WINDOW_S = 86_400  # the agents' GetGpuMetrics takes up to a day (they keep about an hour)
MAX_POINTS = 2_000
DEFAULT_NODE_WINDOW_S = 900
DEFAULT_POINTS = 180
DEFAULT_FLEET_WINDOW_S = 3_600

Window = Annotated[int, Query(ge=0, le=MAX_WINDOW_S, description="seconds back from now; 0: the latest poll only")]
Points = Annotated[int, Query(ge=1, le=MAX_POINTS, description=(
    "at most this many points per GPU: a window holding more polls is cut into this many equal slices, each "
    "the mean of its polls"))]


@router.get("/v1/nodes/{node_id}/metrics", response_model=NodeMetrics,
            summary="A node's GPU utilization, memory, temperature and power over time, and its XID and health history",
            description="From the node agent's ring buffer of its own polls (about the last hour, one poll per "
                        "heartbeat interval), so it works without a Prometheus server. 503 when the node's agent "
                        "does not answer.",
            responses=error_responses(400, 401, 403, 404, 409, 429, 503))
async def node_metrics(node_id: NodeId, principal: NodeReader, deps: Deps,
                       window: Window = DEFAULT_NODE_WINDOW_S, points: Points = DEFAULT_POINTS) -> NodeMetrics:
    node = await deps.scheduler.get_node(node_id)  # 404 for a node the scheduler does not know
    if not node.agent_address:
        raise Unavailable(f"node {node_id} has no agent address: its agent has not registered")
    try:
        reply = await deps.agents.gpu_metrics(node.agent_address, node_id=node_id, window_s=window, max_points=points)
    except FailedPrecondition:
        raise  # the node's agent cannot be verified (its id is no principal name): nothing was asked
    except TrainyardError as exc:
        # Whatever the agent answered, to this caller the node's metrics are unavailable for now.
        show = roles.allows(principal, roles.Action.NODES_ADDRESSES)
        raise Unavailable(failure(exc, node_id, show_addresses=show)) from None
    return convert.node_metrics_from_pb(node_id, window, reply)


@router.get("/v1/fleet/metrics", response_model=FleetMetrics,
            summary="The fleet's allocation over time and every GPU's latest utilization",
            description="`allocation`: the GPUs jobs held, of those on ready nodes, by model, as this gateway "
                        "recorded them every fleet_sample_interval_s since it was first asked (the last 24 hours at "
                        "most). "
                        "`gpus`: every GPU with its node agent's latest poll; the agents that do not answer are "
                        "listed in `unreachable` and their GPUs' values are null.",
            responses=error_responses(400, 401, 403, 429, 503))
async def fleet_metrics(principal: NodeReader, deps: Deps, window: Window = DEFAULT_FLEET_WINDOW_S) -> FleetMetrics:
    nodes = await deps.scheduler.list_nodes()
    now = datetime.now(UTC)
    show = roles.allows(principal, roles.Action.NODES_ADDRESSES)
    if deps.latest_gpus is not None:
        gpus, unreachable = await deps.latest_gpus.read(nodes, show_addresses=show)
    else:
        gpus, unreachable = [], []
    history = deps.fleet_history
    if history is not None:
        history.observe(nodes)
    return FleetMetrics(as_of=now, window_s=window, sample_interval_s=deps.settings.fleet_sample_interval_s,
                        allocation=history.window(window, now) if history is not None else [], gpus=gpus,
                        unreachable=unreachable)
