"""Simulated hardware: what the fake NVML reports for each `--gpu-profile`.

Values follow what the real parts report through NVML (device names, memory in MiB, compute capability,
PCI bus ids of typical HGX / PCIe servers), so the scheduler sees the same shapes as in production.

Topology of each profile:
- `pcie_paths`: per GPU, the PCIe path from its CPU socket down: socket, host bridge, then the PCIe
  switches above the GPU. Two GPUs' closest common ancestor follows from the longest common prefix (see
  `common_ancestor`), as nvmlDeviceGetTopologyCommonAncestor reports it. The socket is the NUMA node.
- NVLink: "nvswitch" (every link of every GPU goes to one of `nvswitches` switches: one island of all
  GPUs, as on HGX boards), "mesh" (direct links, `nvlinks // (count - 1)` to each other GPU: HGX A100
  4-GPU boards; AMD's xGMI, modelled as NVLink), or "none" (PCIe only).

  h100x8   NVSwitch x4, 18 links per GPU; each GPU on its own host bridge: NODE in a socket, SYS across
  a100x8   NVSwitch x6, 12 links per GPU; GPU pairs under a two-level switch: PXB, NODE, SYS
  a100x4   direct mesh, 4 links per pair; one socket: PXB, NODE
  l40sx4   PCIe only; socket 0: two leaf switches under one switch (PXB); socket 1: one switch (PIX)
  mi300x8  AMD, xGMI mesh (one link per pair, one island); paths as h100x8
  cpu      no GPUs
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model import Vendor
from .api import (
    NVML_TOPOLOGY_HOSTBRIDGE,
    NVML_TOPOLOGY_MULTIPLE,
    NVML_TOPOLOGY_NODE,
    NVML_TOPOLOGY_SINGLE,
    NVML_TOPOLOGY_SYSTEM,
)

PciPath = tuple[str, ...]


@dataclass(frozen=True)
class GpuProfile:
    name: str
    vendor: Vendor
    # Exactly as nvmlDeviceGetName reports it.
    device_name: str
    count: int
    memory_mib: int
    capability: tuple[int, int]
    driver_version: str
    # nvmlSystemGetCudaDriverVersion's encoding: 1000 * major + 10 * minor; 0 when not CUDA.
    cuda_version: int
    # PCI bus numbers, one per GPU.
    pci_buses: tuple[int, ...]
    idle_power_w: int
    nvlink: str = "none"
    nvlinks: int = 0
    nvswitches: int = 0
    pcie_paths: tuple[PciPath, ...] = ()
    mig_capable: bool = False
    # "row_remap" (Ampere and later) or "page_retire" (older parts; AMD retires bad pages too).
    memory_repair: str = "row_remap"
    # Temperature at which the part starts slowing its clocks down.
    slowdown_c: int = 87
    sm_clock_mhz: int = 1980
    memory_clock_mhz: int = 2619

    @property
    def numa_nodes(self) -> int:
        return len({path[0] for path in self.pcie_paths}) or 1

    def numa_node(self, index: int) -> int:
        return int(self.pcie_paths[index][0].removeprefix("s"))


def common_ancestor(a: PciPath, b: PciPath) -> int:
    """NVML's topology level of two GPUs from their PCIe paths (socket, host bridge, switches...)."""
    common = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        common += 1
    if common == 0:
        return NVML_TOPOLOGY_SYSTEM
    if common == 1:
        return NVML_TOPOLOGY_NODE
    if common == 2:
        return NVML_TOPOLOGY_HOSTBRIDGE
    return NVML_TOPOLOGY_SINGLE if a == b else NVML_TOPOLOGY_MULTIPLE


def _own_bridge(count: int, per_socket: int) -> tuple[PciPath, ...]:
    return tuple((f"s{i // per_socket}", f"hb{i}", f"sw{i}") for i in range(count))


def _paired(count: int, per_socket: int) -> tuple[PciPath, ...]:
    return tuple((f"s{i // per_socket}", f"hb{i // 2}", f"sw{i // 2}", f"leaf{i}") for i in range(count))


PROFILES: dict[str, GpuProfile] = {
    p.name: p
    for p in (
        GpuProfile("h100x8", Vendor.NVIDIA, "NVIDIA H100 80GB HBM3", 8, 81559, (9, 0), "550.90.07", 12040,
                   (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB), 72, nvlink="nvswitch", nvlinks=18,
                   nvswitches=4, pcie_paths=_own_bridge(8, 4), mig_capable=True),
        GpuProfile("a100x8", Vendor.NVIDIA, "NVIDIA A100-SXM4-80GB", 8, 81920, (8, 0), "535.183.01", 12020,
                   (0x07, 0x0F, 0x47, 0x4E, 0x87, 0x90, 0xB7, 0xBD), 60, nvlink="nvswitch", nvlinks=12,
                   nvswitches=6, pcie_paths=_paired(8, 4), mig_capable=True, sm_clock_mhz=1410,
                   memory_clock_mhz=1593),
        GpuProfile("a100x4", Vendor.NVIDIA, "NVIDIA A100-SXM4-40GB", 4, 40960, (8, 0), "535.183.01", 12020,
                   (0x07, 0x0F, 0x47, 0x4E), 55, nvlink="mesh", nvlinks=12, pcie_paths=_paired(4, 4),
                   mig_capable=True, sm_clock_mhz=1410, memory_clock_mhz=1215),
        GpuProfile("l40sx4", Vendor.NVIDIA, "NVIDIA L40S", 4, 46068, (8, 9), "550.90.07", 12040,
                   (0x1B, 0x3D, 0x9C, 0xBE), 35,
                   pcie_paths=(("s0", "hb0", "sw0", "leaf0"), ("s0", "hb0", "sw0", "leaf1"),
                               ("s1", "hb1", "sw1"), ("s1", "hb1", "sw1")),
                   sm_clock_mhz=2520, memory_clock_mhz=9001),
        GpuProfile("mi300x8", Vendor.AMD, "AMD Instinct MI300X", 8, 196592, (9, 4), "6.7.0", 0,
                   (0x05, 0x15, 0x65, 0x75, 0x85, 0x95, 0xE5, 0xF5), 140, nvlink="mesh", nvlinks=7,
                   pcie_paths=_own_bridge(8, 4), memory_repair="page_retire", slowdown_c=100,
                   sm_clock_mhz=2100, memory_clock_mhz=1300),
        GpuProfile("cpu", Vendor.NVIDIA, "", 0, 0, (0, 0), "", 0, (), 0),
    )
}


def get_profile(name: str) -> GpuProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown GPU profile {name!r}; known: {', '.join(sorted(PROFILES))}") from None
