"""A fake NVML for hosts without GPUs: same function names, arguments, return shapes and errors as pynvml.

It implements exactly the functions `NvmlModule` lists (the adapter's calls). Return values are the real
pynvml ctypes structures (`nvmlPciInfo_t`, `c_nvmlMemory_t`, `c_nvmlUtilization_t`) and errors are real
`pynvml.NVMLError` subclasses, so the adapter cannot tell the difference. Devices come from a profile
(`profiles.py`); UUIDs are derived from `seed` so two simulated nodes never share a GPU UUID.

Fault controls (`fall_off_bus`, `inject_xid`, `add_ecc_errors`, `set_temperature`) change what later
NVML calls return, as the hardware would: a GPU off the bus answers every call with GPU_IS_LOST. XIDs
are queued in `pending_xids` for the event-set reader issue 3 adds (`nvmlEventSetWait`).

Thread-safe: the monitor polls from a worker thread while faults are injected from the event loop.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

import pynvml

from ..model import Vendor
from .profiles import GpuProfile, get_profile

_MIB = 1024 * 1024
# PCI device ids as the real parts report them (device << 16 | vendor).
_PCI_DEVICE_IDS = {"H100": 0x233010DE, "A100": 0x20B210DE, "L40S": 0x26B910DE, "MI300X": 0x74A11002}


@dataclass
class FakeGpu:
    index: int
    uuid: str
    bus: int
    lost: bool = False
    utilization_percent: int = 0
    memory_used_mib: int = 0
    temperature_c: int = 34
    power_mw: int = 0
    ecc_uncorrectable: int = 0
    xids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _Handle:
    """Stands for pynvml's opaque c_nvmlDevice_t."""

    index: int


class FakeNvml:
    """A pynvml-compatible module object driven by a hardware profile."""

    NVMLError = pynvml.NVMLError
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU

    def __init__(self, profile: GpuProfile | str, *, seed: str = "") -> None:
        self.profile = get_profile(profile) if isinstance(profile, str) else profile
        self._lock = threading.Lock()
        self._init_count = 0
        self.gpus = [
            FakeGpu(index=i, uuid=self._uuid(seed, i), bus=self.profile.pci_buses[i],
                    temperature_c=33 + i % 4, power_mw=self.profile.idle_power_w * 1000)
            for i in range(self.profile.count)
        ]
        self.pending_xids: list[tuple[int, int]] = []

    @property
    def vendor(self) -> Vendor:
        return self.profile.vendor

    def _uuid(self, seed: str, index: int) -> str:
        u = uuid.uuid5(uuid.NAMESPACE_URL, f"trainyard-fake-gpu/{seed}/{self.profile.name}/{index}")
        return f"GPU-{u}" if self.profile.vendor is Vendor.NVIDIA else str(u)

    # --- pynvml API -------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        with self._lock:
            self._init_count += 1

    def nvmlShutdown(self) -> None:
        with self._lock:
            self._require_init()
            self._init_count -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        with self._lock:
            self._require_init()
            return self.profile.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        with self._lock:
            self._require_init()
            if not self.profile.cuda_version:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return self.profile.cuda_version

    def nvmlDeviceGetCount(self) -> int:
        with self._lock:
            self._require_init()
            return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        with self._lock:
            self._require_init()
            if not 0 <= index < len(self.gpus):
                raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            return _Handle(index)

    def nvmlDeviceGetName(self, handle: Any) -> str:
        with self._lock:
            self._gpu(handle)
            return self.profile.device_name

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        with self._lock:
            return self._gpu(handle).uuid

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        with self._lock:
            gpu = self._gpu(handle)
            info = pynvml.nvmlPciInfo_t()
            info.domain, info.bus, info.device = 0, gpu.bus, 0
            info.busId = (pynvml.NVML_DEVICE_PCI_BUS_ID_FMT % (0, gpu.bus, 0)).encode()
            info.busIdLegacy = (pynvml.NVML_DEVICE_PCI_BUS_ID_LEGACY_FMT % (0, gpu.bus, 0)).encode()
            info.pciDeviceId = next((v for k, v in _PCI_DEVICE_IDS.items() if k in self.profile.device_name),
                                    0)
            return info

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Any = None) -> Any:
        with self._lock:
            gpu = self._gpu(handle)
            mem = pynvml.c_nvmlMemory_t() if not version else pynvml.c_nvmlMemory_v2_t()
            mem.total = self.profile.memory_mib * _MIB
            mem.used = gpu.memory_used_mib * _MIB
            mem.free = mem.total - mem.used
            return mem

    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]:
        with self._lock:
            self._gpu(handle)
            return self.profile.capability

    def nvmlDeviceGetNumaNodeId(self, handle: Any) -> int:
        with self._lock:
            gpu = self._gpu(handle)
            per_node = max(1, len(self.gpus) // self.profile.numa_nodes)
            return min(gpu.index // per_node, self.profile.numa_nodes - 1)

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        with self._lock:
            gpu = self._gpu(handle)
            util = pynvml.c_nvmlUtilization_t()
            util.gpu = gpu.utilization_percent
            util.memory = gpu.utilization_percent // 2
            return util

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        with self._lock:
            gpu = self._gpu(handle)
            if sensor != pynvml.NVML_TEMPERATURE_GPU:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            return gpu.temperature_c

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        with self._lock:
            return self._gpu(handle).power_mw

    # --- fault and load controls (not part of pynvml) ----------------------------------------------

    def fall_off_bus(self, index: int) -> None:
        with self._lock:
            self._by_index(index).lost = True
            self.pending_xids.append((index, 79))

    def inject_xid(self, index: int, xid: int) -> None:
        with self._lock:
            self._by_index(index).xids.append(xid)
            self.pending_xids.append((index, xid))

    def add_ecc_errors(self, index: int, count: int) -> int:
        with self._lock:
            gpu = self._by_index(index)
            gpu.ecc_uncorrectable += count
            return gpu.ecc_uncorrectable

    def set_temperature(self, index: int, celsius: int) -> None:
        with self._lock:
            self._by_index(index).temperature_c = celsius

    def set_load(self, index: int, utilization_percent: int, memory_used_mib: int) -> None:
        with self._lock:
            gpu = self._by_index(index)
            gpu.utilization_percent = utilization_percent
            gpu.memory_used_mib = memory_used_mib

    # --- internals -----------------------------------------------------------------------------------

    def _require_init(self) -> None:
        if self._init_count <= 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)

    def _by_index(self, index: int) -> FakeGpu:
        if not 0 <= index < len(self.gpus):
            raise IndexError(f"GPU {index} does not exist (profile {self.profile.name} has {len(self.gpus)})")
        return self.gpus[index]

    def _gpu(self, handle: Any) -> FakeGpu:
        self._require_init()
        if not isinstance(handle, _Handle) or not 0 <= handle.index < len(self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[handle.index]
        if gpu.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return gpu
