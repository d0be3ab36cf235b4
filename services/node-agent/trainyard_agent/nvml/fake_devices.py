"""The fake NVML's simulated devices: their state, their handles and event sets, and the lookups every call
makes (fake.py has the module object and what it is; fake_controls.py the fault and load controls).

One lock guards all of it: the monitor polls from a worker thread and waits for events in another while faults
are injected from the event loop. `_events_ready` is a condition of that lock.
"""

from __future__ import annotations

import ctypes
import os
import threading
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import pynvml

from ..model import Vendor
from . import api
from .profiles import GpuProfile, get_profile

_MIB = 1024 * 1024
# PCI device ids as the real parts report them (device << 16 | vendor).
_PCI_DEVICE_IDS = {"H100": 0x233010DE, "A100": 0x20B210DE, "L40S": 0x26B910DE, "MI300X": 0x74A11002}
_SUPPORTED_EVENTS = (api.EVENT_SINGLE_BIT_ECC | api.EVENT_DOUBLE_BIT_ECC | api.EVENT_XID_CRITICAL
                     | api.EVENT_DRAM_RETIREMENT | api.EVENT_DRAM_RETIREMENT_FAILURE)
# NVSwitches sit on their own PCI buses, away from the GPUs'.
_SWITCH_BUS_BASE = 0xC0
_THERMAL_REASONS = 0x0008 | 0x0020 | 0x0040  # hw_slowdown | sw_thermal | hw_thermal


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
    sm_clock_mhz: int = 0
    memory_clock_mhz: int = 0
    throttle_reasons: int = 0
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    ecc_aggregate_uncorrected: int = 0
    remapped_rows_pending: bool = False
    remapped_rows_failure: bool = False
    retired_pages: list[int] = field(default_factory=list)
    retired_pages_pending: bool = False
    nvlink_errors: int = 0
    # The same errors by nvmlNvLinkErrorCounter_t (all of them on link 0).
    nvlink_errors_by_counter: dict[int, int] = field(default_factory=dict)
    pcie_replays: int = 0
    mig_mode: int = 0
    xids: list[int] = field(default_factory=list)


@dataclass
class _EventSet:
    registrations: dict[int, int] = field(default_factory=dict)
    queue: deque[tuple[int, int, int]] = field(default_factory=deque)


def _opaque(kind: Any) -> tuple[Any, ctypes.Array[ctypes.c_char]]:
    """A fresh pointer of pynvml's opaque handle type `kind`, and the buffer it points at (kept alive)."""
    buffer = ctypes.create_string_buffer(8)
    return ctypes.cast(buffer, kind), buffer


def _address(pointer: Any) -> int | None:
    try:
        return ctypes.cast(pointer, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None


def _error(code: int) -> pynvml.NVMLError:
    # pynvml's NVMLError(code) builds the matching subclass (NVMLError_GpuIsLost, NVMLError_Timeout, ...).
    return pynvml.NVMLError(code)


class FakeDevices:
    """The simulated GPUs of one host, from a hardware profile. `host_cpus` is how many CPUs the simulated host
    has (default: this machine's), split evenly over the profile's NUMA nodes, so CPU affinity names CPUs that
    exist here."""

    def __init__(self, profile: GpuProfile | str, *, seed: str = "", host_cpus: int | None = None) -> None:
        self.profile = get_profile(profile) if isinstance(profile, str) else profile
        self._lock = threading.Lock()
        self._events_ready = threading.Condition(self._lock)
        self._init_count = 0
        p = self.profile
        self.gpus = [
            FakeGpu(index=i, uuid=self._uuid(seed, i), bus=p.pci_buses[i], temperature_c=33 + i % 4,
                    power_mw=p.idle_power_w * 1000, sm_clock_mhz=p.sm_clock_mhz,
                    memory_clock_mhz=p.memory_clock_mhz)
            for i in range(p.count)
        ]
        self._handles = [_opaque(pynvml.c_nvmlDevice_t) for _ in self.gpus]
        self._index_by_address = {_address(h): i for i, (h, _) in enumerate(self._handles)}
        self._event_sets: dict[int, tuple[_EventSet, Any]] = {}
        cpus = host_cpus or os.cpu_count() or 1
        nodes = p.numa_nodes
        per_node = cpus // nodes
        self._numa_cpus = [tuple(range(n * per_node, (n + 1) * per_node)) if per_node else tuple(range(cpus))
                           for n in range(nodes)]

    @property
    def vendor(self) -> Vendor:
        return self.profile.vendor

    def _uuid(self, seed: str, index: int) -> str:
        u = uuid.uuid5(uuid.NAMESPACE_URL, f"trainyard-fake-gpu/{seed}/{self.profile.name}/{index}")
        return f"GPU-{u}" if self.profile.vendor is Vendor.NVIDIA else str(u)

    # --- internals -----------------------------------------------------------------------------------

    def _post(self, index: int, event_type: int, data: int) -> None:
        """Queue an event on every set registered for it (the caller holds the lock)."""
        for event_set, _ in self._event_sets.values():
            if event_set.registrations.get(index, 0) & event_type:
                event_set.queue.append((index, event_type, data))
        self._events_ready.notify_all()

    def _pci_info(self, bus: int) -> Any:
        info = pynvml.nvmlPciInfo_t()
        info.domain, info.bus, info.device = 0, bus, 0
        info.busId = (pynvml.NVML_DEVICE_PCI_BUS_ID_FMT % (0, bus, 0)).encode()
        info.busIdLegacy = (pynvml.NVML_DEVICE_PCI_BUS_ID_LEGACY_FMT % (0, bus, 0)).encode()
        return info

    def _check_link(self, link: int) -> None:
        if self.profile.nvlink == "none":
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < self.profile.nvlinks:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def _require_init(self) -> None:
        if self._init_count <= 0:
            raise _error(pynvml.NVML_ERROR_UNINITIALIZED)

    def _by_index(self, index: int) -> FakeGpu:
        if not 0 <= index < len(self.gpus):
            raise IndexError(f"GPU {index} does not exist (profile {self.profile.name} has {len(self.gpus)})")
        return self.gpus[index]

    def _event_set(self, handle: Any) -> _EventSet:
        found = self._event_sets.get(_address(handle) or 0) if isinstance(handle, pynvml.c_nvmlEventSet_t) else None
        if found is None:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return found[0]

    def _gpu(self, handle: Any) -> FakeGpu:
        self._require_init()
        index = self._index_by_address.get(_address(handle)) if isinstance(handle, pynvml.c_nvmlDevice_t) else None
        if index is None:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[index]
        if gpu.lost:
            raise _error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return gpu
