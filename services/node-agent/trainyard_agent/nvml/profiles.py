"""Simulated hardware: what the fake NVML reports for each `--gpu-profile`.

Values follow what the real parts report through NVML (device names, memory in MiB, compute capability,
PCI bus ids of typical HGX / PCIe servers), so the scheduler sees the same shapes as in production.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model import Vendor


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
    # PCI bus numbers, one per GPU; NUMA node = first half 0, second half 1 on two-socket hosts.
    pci_buses: tuple[int, ...]
    numa_nodes: int
    idle_power_w: int
    # "nvswitch": every GPU reaches every other over NVLink; "none": PCIe only.
    nvlink: str


def _buses(*values: int) -> tuple[int, ...]:
    return tuple(values)


PROFILES: dict[str, GpuProfile] = {
    p.name: p
    for p in (
        GpuProfile("h100x8", Vendor.NVIDIA, "NVIDIA H100 80GB HBM3", 8, 81559, (9, 0), "550.90.07", 12040,
                   _buses(0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB), 2, 72, "nvswitch"),
        GpuProfile("a100x8", Vendor.NVIDIA, "NVIDIA A100-SXM4-80GB", 8, 81920, (8, 0), "535.183.01", 12020,
                   _buses(0x07, 0x0F, 0x47, 0x4E, 0x87, 0x90, 0xB7, 0xBD), 2, 60, "nvswitch"),
        GpuProfile("a100x4", Vendor.NVIDIA, "NVIDIA A100-SXM4-40GB", 4, 40960, (8, 0), "535.183.01", 12020,
                   _buses(0x07, 0x0F, 0x47, 0x4E), 1, 55, "nvswitch"),
        GpuProfile("l40sx4", Vendor.NVIDIA, "NVIDIA L40S", 4, 46068, (8, 9), "550.90.07", 12040,
                   _buses(0x1B, 0x3D, 0x9C, 0xBE), 2, 35, "none"),
        GpuProfile("mi300x8", Vendor.AMD, "AMD Instinct MI300X", 8, 196592, (9, 4), "6.7.0", 0,
                   _buses(0x05, 0x15, 0x65, 0x75, 0x85, 0x95, 0xE5, 0xF5), 2, 140, "xgmi"),
        GpuProfile("cpu", Vendor.NVIDIA, "", 0, 0, (0, 0), "", 0, (), 1, 0, "none"),
    )
}


def get_profile(name: str) -> GpuProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown GPU profile {name!r}; known: {', '.join(sorted(PROFILES))}") from None
