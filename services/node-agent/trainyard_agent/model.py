"""The agent's vendor-neutral view of its host: accelerators, their topology, health and metrics, the node.

Nothing here knows NVML or protobuf: a backend (`backend.py`; today the NVML adapter) produces these,
`grpc/convert.py` maps them to the wire. A second vendor's backend (amdsmi, Ascend) produces the same
objects: an accelerator is a vendor, a model, memory and a capability, wherever it comes from.
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


class Action(enum.StrEnum):
    """What the health policy asks for, mildest first (`severity` orders them).

    - ignore: nothing; an application error (the job's own failure handling applies) or a condition that
      only lowers performance.
    - restart_job: the work on this GPU should restart (from its checkpoint); the GPU may be used again.
    - reset_gpu: this GPU is out of service until it is reset (or an operator marks it healthy); the node's
      other GPUs keep working.
    - drain_node: the node is cordoned and its jobs evacuated (hardware to repair or replace).
    - reboot_host: as drain_node, and the host needs a reboot before it is used again.
    """

    IGNORE = "ignore"
    RESTART_JOB = "restart_job"
    RESET_GPU = "reset_gpu"
    DRAIN_NODE = "drain_node"
    REBOOT_HOST = "reboot_host"

    @property
    def severity(self) -> int:
        return _ACTION_ORDER.index(self)

    @property
    def drains_node(self) -> bool:
        return self in (Action.DRAIN_NODE, Action.REBOOT_HOST)


_ACTION_ORDER = tuple(Action)

# What the wire (Gpu.health_action) says when the policy asks for nothing.
NO_ACTION = "none"


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
    # GPUs joined by NVLink (or another vendor's GPU-to-GPU fabric, e.g. xGMI) share an island id, numbered
    # from 0 in order of their lowest GPU index; -1 when the GPU has no such link.
    nvlink_island: int = -1
    # CPUs close to this GPU (its NUMA node's), for binding its worker; empty when unknown.
    cpu_affinity: tuple[int, ...] = ()
    mig_enabled: bool = False
    health: Health = Health.HEALTHY
    health_reason: str = ""
    health_action: Action = Action.IGNORE

    def with_health(self, health: Health, reason: str, action: Action = Action.IGNORE) -> Accelerator:
        return replace(self, health=health, health_reason=reason, health_action=action)

    @property
    def wire_action(self) -> str:
        """The action as Gpu.health_action carries it: "none" when nothing is to be done."""
        if self.health is Health.HEALTHY or self.health_action is Action.IGNORE:
            return NO_ACTION
        return self.health_action.value


@dataclass(frozen=True)
class GpuLink:
    """How two GPUs of the node are connected. `level` is the closest common PCIe ancestor as NVML names
    it (PIX, PXB, PHB, NODE, SYS), always filled; `nvlinks` counts the NVLink (xGMI) links between them, 0
    when they talk over PCIe only."""

    gpu_a: int
    gpu_b: int
    level: str
    nvlinks: int = 0


@dataclass(frozen=True)
class HealthCounters:
    """Error counters of one GPU as the driver keeps them. They only grow (until a reset or reboot), so a
    threshold is applied to what grew since an operator last acknowledged them (see health/book.py)."""

    ecc_volatile_corrected: int = 0
    # Since the driver loaded (or the GPU was reset): what the thresholds look at.
    ecc_volatile_uncorrected: int = 0
    # Over the GPU's lifetime: reported, not judged.
    ecc_aggregate_uncorrected: int = 0
    # Row remapping (Ampere and later): a remap waiting for a GPU reset, a remap that failed (RMA).
    remapped_rows_pending: bool = False
    remapped_rows_failure: bool = False
    # Page retirement (before Ampere): pages retired for either cause, and a retirement waiting for a reset.
    retired_pages: int = 0
    retired_pages_pending: bool = False
    # Sum of the NVLink data-link error counters (replay, recovery, CRC, ECC) over the active links.
    nvlink_errors: int = 0
    pcie_replays: int = 0
    # The same NVLink errors by kind (nvmlNvLinkErrorCounter_t), summed over the active links: what the
    # metrics export under DCGM's names. The thresholds look at the sum above.
    nvlink_replay_errors: int = 0
    nvlink_recovery_errors: int = 0
    nvlink_crc_flit_errors: int = 0
    nvlink_crc_data_errors: int = 0
    nvlink_ecc_data_errors: int = 0

    def since(self, baseline: HealthCounters) -> HealthCounters:
        """Counts above `baseline`. A count below its baseline was restarted (a GPU reset or a driver reload
        clears the volatile counters): all of it is new. The pending and failure flags are states, not
        counts: they stay unless the baseline had them too."""

        def grown(value: int, base: int) -> int:
            return value - base if value >= base else value

        return HealthCounters(
            ecc_volatile_corrected=grown(self.ecc_volatile_corrected, baseline.ecc_volatile_corrected),
            ecc_volatile_uncorrected=grown(self.ecc_volatile_uncorrected, baseline.ecc_volatile_uncorrected),
            ecc_aggregate_uncorrected=grown(self.ecc_aggregate_uncorrected, baseline.ecc_aggregate_uncorrected),
            remapped_rows_pending=self.remapped_rows_pending and not baseline.remapped_rows_pending,
            remapped_rows_failure=self.remapped_rows_failure and not baseline.remapped_rows_failure,
            retired_pages=grown(self.retired_pages, baseline.retired_pages),
            retired_pages_pending=self.retired_pages_pending and not baseline.retired_pages_pending,
            nvlink_errors=grown(self.nvlink_errors, baseline.nvlink_errors),
            pcie_replays=grown(self.pcie_replays, baseline.pcie_replays),
            nvlink_replay_errors=grown(self.nvlink_replay_errors, baseline.nvlink_replay_errors),
            nvlink_recovery_errors=grown(self.nvlink_recovery_errors, baseline.nvlink_recovery_errors),
            nvlink_crc_flit_errors=grown(self.nvlink_crc_flit_errors, baseline.nvlink_crc_flit_errors),
            nvlink_crc_data_errors=grown(self.nvlink_crc_data_errors, baseline.nvlink_crc_data_errors),
            nvlink_ecc_data_errors=grown(self.nvlink_ecc_data_errors, baseline.nvlink_ecc_data_errors))


@dataclass(frozen=True)
class AcceleratorMetrics:
    index: int
    utilization_percent: int
    memory_used_mb: int
    temperature_c: int
    power_w: int
    sm_clock_mhz: int = 0
    memory_clock_mhz: int = 0
    # Active clock throttle reasons by name ("hw_slowdown", "hw_thermal", "hw_power_brake", "sw_thermal",
    # "sw_power_cap", ...); idle is left out: it is not a slowdown.
    throttle_reasons: tuple[str, ...] = ()
    # The latest read of the counters (read less often than the rest, see GpuMonitor).
    counters: HealthCounters = field(default_factory=HealthCounters)


@dataclass(frozen=True)
class Inventory:
    """What the accelerator backend reports once at start-up: the GPUs and how they are connected."""

    vendor: Vendor
    driver_version: str
    accelerators: tuple[Accelerator, ...]
    # "12.4" for NVIDIA (the CUDA version the driver supports); empty when unknown.
    runtime_version: str = ""
    # One entry per pair of GPUs (a < b) whose connection could be read.
    links: tuple[GpuLink, ...] = ()


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
    cuda_version: str = ""
    gpu_links: tuple[GpuLink, ...] = ()


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
