"""The agent's vendor-neutral view of its host: accelerators, their health and metrics, the node.

Nothing here knows NVML or protobuf: the NVML adapter produces these, `grpc/convert.py` maps them to the
wire. A second vendor's backend (amdsmi, Ascend) produces the same objects.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace


class Vendor(enum.StrEnum):
    NVIDIA = "nvidia"
    AMD = "amd"


class Health(enum.IntEnum):
    """Ordered by severity, so the worse of two states is `max(a, b)`."""

    HEALTHY = 1
    DEGRADED = 2
    UNHEALTHY = 3


@dataclass(frozen=True)
class Accelerator:
    index: int
    uuid: str
    vendor: Vendor
    # Normalised model name users ask for ("H100-80GB-HBM3"); `name` is what the driver reports.
    model: str
    name: str
    memory_mb: int
    pci_bus_id: str
    # "9.0"-style compute capability; AMD parts report the same major.minor torch sees (MI300X: "9.4").
    capability: str
    numa_node: int = -1
    # GPUs joined by NVLink share an island id; -1 when unknown or none (topology comes with issue 3).
    nvlink_island: int = -1
    health: Health = Health.HEALTHY
    health_reason: str = ""

    def with_health(self, health: Health, reason: str) -> Accelerator:
        return replace(self, health=health, health_reason=reason)


@dataclass(frozen=True)
class AcceleratorMetrics:
    index: int
    utilization_percent: int
    memory_used_mb: int
    temperature_c: int
    power_w: int


@dataclass(frozen=True)
class Inventory:
    """What the accelerator backend reports once at start-up."""

    vendor: Vendor
    driver_version: str
    accelerators: tuple[Accelerator, ...]
    # "12.4" for NVIDIA; empty when unknown.
    runtime_version: str = ""


@dataclass(frozen=True)
class NodeInfo:
    """Everything RegisterNode says about this host."""

    node_id: str
    hostname: str
    agent_address: str
    worker_address: str
    accelerators: tuple[Accelerator, ...]
    cpus: int
    memory_mb: int
    driver_version: str
    simulated: bool
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RunningAllocation:
    job_id: str
    attempt: int
    ranks: tuple[int, ...]


def normalise_model(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' → 'H100-80GB-HBM3', 'AMD Instinct MI300X' → 'Instinct-MI300X'."""
    words = name.split()
    if words and words[0].upper() in ("NVIDIA", "AMD"):
        words = words[1:]
    return "-".join(words) or name
