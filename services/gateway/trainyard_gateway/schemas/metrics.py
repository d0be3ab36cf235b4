"""GPU telemetry over time, as GET /v1/nodes/{id}/metrics and GET /v1/fleet/metrics answer it: what the web
console charts without a Prometheus server (the agents' ring buffers of their polls, and the gateway's own
record of the fleet's allocation)."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field

from .common import ApiModel
from .nodes import GpuHealth

GpuEventKind = Literal["xid", "health"]


class GpuSample(ApiModel):
    time: datetime = Field(description="when the agent polled the GPU (for a mean of several polls, the last one)")
    utilization_percent: float
    memory_used_mb: float
    temperature_c: float
    power_w: float
    sm_clock_mhz: float


class GpuSeries(ApiModel):
    index: int = Field(description="the GPU's index on its node")
    samples: list[GpuSample] = Field(description="oldest first; each the mean of the polls in its slice of the "
                                                 "window when the window holds more polls than `points`")


class GpuHealthEvent(ApiModel):
    time: datetime
    gpu: int = Field(description="the GPU's index on its node")
    kind: GpuEventKind = Field(description="xid: the driver reported an XID (`xid`; `health` and `reason` the "
                                           "node's health policy's verdict on it); health: the GPU's health or its "
                                           "reason changed (to `health`, because of `reason`)")
    xid: int = Field(description="the XID; 0 for a health event")
    health: GpuHealth
    reason: str


class NodeMetrics(ApiModel):
    node_id: str
    window_s: int = Field(description="the window asked for, ending at `as_of`; 0: the latest poll only")
    interval_s: float = Field(description="how often the node's agent polls its GPUs")
    as_of: datetime = Field(description="the agent's clock when it answered")
    retained_since: datetime | None = Field(description="the oldest poll the agent still keeps (it keeps about an "
                                                        "hour); null before its first poll")
    gpus: list[GpuSeries]
    events: list[GpuHealthEvent] = Field(description="the XIDs and health changes the agent keeps (the latest few "
                                                     "hundred, since it started), oldest first")


class ModelAllocation(ApiModel):
    total: int = Field(description="GPUs of this model on ready nodes (cordoned ones included)")
    allocated: int = Field(description="of them, held by a job's allocation")


class AllocationPoint(ApiModel):
    time: datetime
    nodes_ready: int = Field(description="nodes whose agents answer the scheduler (cordoned ones included)")
    nodes_total: int
    gpus_total: int = Field(description="GPUs on ready nodes (cordoned ones included)")
    gpus_allocated: int = Field(description="of them, held by a job's allocation")
    gpus_unhealthy: int = Field(description="of them, degraded or unhealthy")
    models: dict[str, ModelAllocation] = Field(description="the same by accelerator model")


class FleetGpu(ApiModel):
    node_id: str
    index: int
    model: str
    memory_mb: int
    health: GpuHealth
    allocated: bool
    utilization_percent: float | None = Field(description="the agent's latest poll; null when its agent did not "
                                                          "answer (the node is then in `unreachable`)")
    memory_used_mb: float | None
    temperature_c: float | None
    power_w: float | None


class UnreachableNode(ApiModel):
    node_id: str
    message: str


class FleetMetrics(ApiModel):
    as_of: datetime
    window_s: int = Field(description="the window of `allocation`, ending at `as_of`")
    sample_interval_s: float = Field(description="how often the gateway records the allocation (its "
                                                 "fleet_sample_interval_s setting)")
    allocation: list[AllocationPoint] = Field(description="the fleet's allocation over the window, oldest first, as "
                                                          "this gateway recorded it since it was first asked "
                                                          "(this route starts the recording)")
    gpus: list[FleetGpu] = Field(description="every GPU of every node with its agent's latest poll, by node then "
                                             "index")
    unreachable: list[UnreachableNode] = Field(description="nodes whose agents did not answer")
