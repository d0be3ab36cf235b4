"""Nodes as the API shows them: inventory, health and how many GPUs are free."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import Field

from trainyard_core import contract as c

from .common import ApiModel, Bool

NodeState = Literal["ready", "not_ready", "cordoned", "unknown"]
GpuHealth = Literal["healthy", "degraded", "unhealthy", "unknown"]


class Gpu(ApiModel):
    index: int
    uuid: str
    vendor: str
    model: str
    memory_mb: int
    compute_capability: str
    health: GpuHealth
    health_reason: str
    health_action: str = Field("none", description="what the node's health policy asks for this GPU's state")
    numa_node: int
    nvlink_island: int = Field(description="GPUs joined by NVLink share an island id; -1 when none")
    allocated: bool = Field(description="held by a job's allocation")


class Node(ApiModel):
    node_id: str
    hostname: str | None = Field(description="the host's name; shown to operator tokens only (null for others)")
    agent_address: str | None = Field(description="host:port of the node agent's gRPC API; shown to operator "
                                                  "tokens only (null for others)")
    state: NodeState
    cordoned: bool
    cordon_reason: str = ""
    gpus_total: int
    gpus_free: int = Field(description="healthy GPUs not held by any allocation (0 unless the node is ready)")
    models: list[str] = Field(description="distinct accelerator models on the node")
    gpus: list[Gpu]
    cpus: int
    memory_mb: int
    labels: dict[str, str]
    driver_version: str
    simulated: bool
    registered_at: datetime | None
    last_heartbeat: datetime | None


class NodeList(ApiModel):
    nodes: list[Node]


class CordonRequest(ApiModel):
    reason: str = Field("", max_length=c.MAX_REASON_LENGTH,
                        description="why; shown on the node and in the scheduler's log")


class GpuHealthRequest(ApiModel):
    healthy: Annotated[Bool, Field(description=(
        "true: back in service (after repair); false: take it out of service. A JSON boolean: 0, 1 or "
        '"false" are refused'))]
    reason: str = Field(max_length=c.MAX_GPU_HEALTH_REASON_LENGTH, pattern=c.GPU_HEALTH_REASON.pattern,
                        description=f"why; written to the node's audit log: {c.GPU_HEALTH_REASON.rule}")
