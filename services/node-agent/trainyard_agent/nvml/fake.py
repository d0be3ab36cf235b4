"""A fake NVML for hosts without GPUs: same function names, arguments, return shapes and errors as pynvml.

It implements exactly the functions `api.NvmlModule` lists (the adapter's calls). Return values are the real
pynvml ctypes structures (`nvmlPciInfo_t`, `c_nvmlMemory_t`, `c_nvmlUtilization_t`, `c_nvmlEventData_t`),
device and event-set handles are real ctypes pointers (`c_nvmlDevice_t`, `c_nvmlEventSet_t`), and errors are
real `pynvml.NVMLError` subclasses, so the adapter cannot tell the difference. Devices come from a profile
(`profiles.py`); UUIDs are derived from `seed` so two simulated nodes never share a GPU UUID.

Fault controls (not part of pynvml) change what later NVML calls return and post the events the driver
would post, to every event set registered for them:
- `inject_xid(i, xid)`: an XID critical-error event;
- `fall_off_bus(i)`: every later call on the GPU raises NVMLError_GpuIsLost, and an XID 79 event is posted;
- `add_ecc_errors(i, n)`: uncorrectable ECC counts rise (volatile and aggregate), a double-bit ECC event;
- `set_temperature(i, c)`: at or above the part's slowdown temperature the clocks drop and the throttle
  reasons say hw_slowdown, hw_thermal and sw_thermal; below it they clear;
- `set_memory_repair(i, ...)`, `add_link_errors(i, ...)`, `set_load(i, ...)`, `set_mig_mode(i, ...)`.

Thread-safe: the monitor polls from a worker thread and waits for events in another while faults are
injected from the event loop. `nvmlEventSetWait` waits on a condition of the lock, so it never holds it.
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
from .profiles import GpuProfile, common_ancestor, get_profile
from .topology import mask_from_cpus

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


class FakeNvml:
    """A pynvml-compatible module object driven by a hardware profile. `host_cpus` is how many CPUs the
    simulated host has (default: this machine's), split evenly over the profile's NUMA nodes, so CPU
    affinity names CPUs that exist here."""

    NVMLError = pynvml.NVMLError
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU

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

    # --- pynvml API: system and handles ------------------------------------------------------------

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
                raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return self.profile.cuda_version

    def nvmlDeviceGetCount(self) -> int:
        with self._lock:
            self._require_init()
            return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        with self._lock:
            self._require_init()
            if not 0 <= index < len(self.gpus):
                raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            return self._handles[index][0]

    # --- inventory ---------------------------------------------------------------------------------------

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
            info = self._pci_info(gpu.bus)
            info.pciDeviceId = next((v for k, v in _PCI_DEVICE_IDS.items() if k in self.profile.device_name), 0)
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

    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]:
        with self._lock:
            gpu = self._gpu(device)
            if not self.profile.mig_capable:
                raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return [gpu.mig_mode, gpu.mig_mode]

    # --- topology ----------------------------------------------------------------------------------------

    def nvmlDeviceGetNumaNodeId(self, handle: Any) -> int:
        with self._lock:
            return self.profile.numa_node(self._gpu(handle).index)

    def nvmlDeviceGetCpuAffinity(self, handle: Any, cpuSetSize: int) -> Any:
        with self._lock:
            gpu = self._gpu(handle)
            if cpuSetSize <= 0:
                raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            words = (ctypes.c_ulonglong * cpuSetSize)()
            for i, word in enumerate(mask_from_cpus(self._numa_cpus[self.profile.numa_node(gpu.index)],
                                                    cpuSetSize)):
                words[i] = word
            return words

    def nvmlDeviceGetNvLinkState(self, device: Any, link: int) -> int:
        with self._lock:
            self._gpu(device)
            self._check_link(link)
            return int(pynvml.NVML_FEATURE_ENABLED)

    def nvmlDeviceGetNvLinkRemotePciInfo(self, device: Any, link: int) -> Any:
        with self._lock:
            gpu = self._gpu(device)
            self._check_link(link)
            p = self.profile
            if p.nvlink == "nvswitch":
                # Links are dealt round the switches: link l goes to switch l mod n.
                return self._pci_info(_SWITCH_BUS_BASE + link % p.nvswitches)
            per_peer = max(1, p.nvlinks // (p.count - 1))
            peers = [i for i in range(p.count) if i != gpu.index]
            return self._pci_info(self.gpus[peers[link // per_peer]].bus)

    def nvmlDeviceGetTopologyCommonAncestor(self, device1: Any, device2: Any) -> int:
        with self._lock:
            a, b = self._gpu(device1), self._gpu(device2)
            return common_ancestor(self.profile.pcie_paths[a.index], self.profile.pcie_paths[b.index])

    # --- live metrics ------------------------------------------------------------------------------------

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
                raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            return gpu.temperature_c

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        with self._lock:
            return self._gpu(handle).power_mw

    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int:
        with self._lock:
            gpu = self._gpu(handle)
            if type in (pynvml.NVML_CLOCK_SM, pynvml.NVML_CLOCK_GRAPHICS):
                return gpu.sm_clock_mhz
            if type == pynvml.NVML_CLOCK_MEM:
                return gpu.memory_clock_mhz
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        with self._lock:
            return int(self._gpu(handle).throttle_reasons)

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int:
        with self._lock:
            return int(self._gpu(handle).throttle_reasons)

    # --- health counters ---------------------------------------------------------------------------------

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int:
        with self._lock:
            gpu = self._gpu(handle)
            if errorType == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED:
                return gpu.ecc_corrected
            if errorType != pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
                raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            if counterType == pynvml.NVML_VOLATILE_ECC:
                return gpu.ecc_uncorrected
            if counterType == pynvml.NVML_AGGREGATE_ECC:
                return gpu.ecc_aggregate_uncorrected
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetRemappedRows(self, device: Any) -> tuple[int, int, int, int]:
        with self._lock:
            gpu = self._gpu(device)
            if self.profile.memory_repair != "row_remap":
                raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return (0, gpu.ecc_uncorrected, int(gpu.remapped_rows_pending), int(gpu.remapped_rows_failure))

    def nvmlDeviceGetRetiredPages(self, device: Any, sourceFilter: int) -> list[int]:
        with self._lock:
            gpu = self._gpu(device)
            if self.profile.memory_repair != "page_retire":
                raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
            # The fake retires pages for double-bit errors only.
            return list(gpu.retired_pages) if sourceFilter == pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR \
                else []

    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: Any) -> int:
        with self._lock:
            gpu = self._gpu(device)
            if self.profile.memory_repair != "page_retire":
                raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return int(gpu.retired_pages_pending)

    def nvmlDeviceGetNvLinkErrorCounter(self, device: Any, link: int, counter: int) -> int:
        with self._lock:
            gpu = self._gpu(device)
            self._check_link(link)
            # All of a GPU's link errors are shown on its link 0, by the kind they were added as.
            return gpu.nvlink_errors_by_counter.get(counter, 0) if link == 0 else 0

    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> int:
        with self._lock:
            return self._gpu(handle).pcie_replays

    # --- events ------------------------------------------------------------------------------------------

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        with self._lock:
            self._gpu(handle)
            return _SUPPORTED_EVENTS

    def nvmlEventSetCreate(self) -> Any:
        with self._lock:
            self._require_init()
            handle, buffer = _opaque(pynvml.c_nvmlEventSet_t)
            self._event_sets[_address(handle) or 0] = (_EventSet(), buffer)
            return handle

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        with self._lock:
            gpu = self._gpu(handle)
            event_set = self._event_set(eventSet)
            if eventTypes & ~_SUPPORTED_EVENTS:
                raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
            event_set.registrations[gpu.index] = event_set.registrations.get(gpu.index, 0) | eventTypes

    def nvmlEventSetWait(self, eventSet: Any, timeoutms: int) -> Any:
        with self._events_ready:
            self._require_init()
            event_set = self._event_set(eventSet)
            if not event_set.queue:
                self._events_ready.wait_for(lambda: bool(event_set.queue), timeout=timeoutms / 1000)
            if not event_set.queue:
                raise _error(pynvml.NVML_ERROR_TIMEOUT)
            index, event_type, data = event_set.queue.popleft()
            event = pynvml.c_nvmlEventData_t()
            event.device = self._handles[index][0]
            event.eventType = event_type
            event.eventData = data
            return event

    def nvmlEventSetFree(self, eventSet: Any) -> None:
        with self._lock:
            self._event_set(eventSet)
            del self._event_sets[_address(eventSet) or 0]

    # --- fault and load controls (not part of pynvml) ----------------------------------------------

    def fall_off_bus(self, index: int) -> None:
        with self._lock:
            self._by_index(index).lost = True
            self._post(index, api.EVENT_XID_CRITICAL, 79)

    def inject_xid(self, index: int, xid: int) -> None:
        with self._lock:
            self._by_index(index).xids.append(xid)
            self._post(index, api.EVENT_XID_CRITICAL, xid)

    def add_ecc_errors(self, index: int, count: int, *, corrected: bool = False) -> int:
        """Raise the ECC counts; returns the volatile count of that kind. Uncorrectable errors retire a page
        on page-retirement parts (pending until a reset) and post a double-bit ECC event."""
        with self._lock:
            gpu = self._by_index(index)
            if corrected:
                gpu.ecc_corrected += count
                return gpu.ecc_corrected
            gpu.ecc_uncorrected += count
            gpu.ecc_aggregate_uncorrected += count
            if self.profile.memory_repair == "page_retire":
                gpu.retired_pages.extend(0x1000 * (len(gpu.retired_pages) + k + 1) for k in range(count))
                gpu.retired_pages_pending = True
            self._post(index, api.EVENT_DOUBLE_BIT_ECC, 0)
            return gpu.ecc_uncorrected

    def set_memory_repair(self, index: int, *, pending: bool = False, failure: bool = False) -> None:
        """Row remapping state (or page retirement's pending flag on page-retirement parts)."""
        with self._lock:
            gpu = self._by_index(index)
            if self.profile.memory_repair == "row_remap":
                gpu.remapped_rows_pending, gpu.remapped_rows_failure = pending, failure
            else:
                gpu.retired_pages_pending = pending
            self._post(index, api.EVENT_DRAM_RETIREMENT_FAILURE if failure else api.EVENT_DRAM_RETIREMENT, 0)

    def add_link_errors(self, index: int, *, nvlink: int = 0, pcie_replays: int = 0,
                        nvlink_counter: int = pynvml.NVML_NVLINK_ERROR_DL_REPLAY) -> None:
        """Raise the NVLink error count of kind `nvlink_counter` (an nvmlNvLinkErrorCounter_t: DL replay by
        default, recovery, CRC flit, CRC data, ECC data) and the PCIe replay count."""
        if nvlink_counter not in api.NVML_NVLINK_ERROR_COUNTERS:
            raise ValueError(f"nvlink_counter {nvlink_counter} is not an NVLink error counter; use one of "
                             f"{api.NVML_NVLINK_ERROR_COUNTERS}")
        with self._lock:
            gpu = self._by_index(index)
            gpu.nvlink_errors += nvlink
            gpu.nvlink_errors_by_counter[nvlink_counter] = gpu.nvlink_errors_by_counter.get(nvlink_counter, 0) + nvlink
            gpu.pcie_replays += pcie_replays

    def set_temperature(self, index: int, celsius: int) -> None:
        with self._lock:
            gpu = self._by_index(index)
            gpu.temperature_c = celsius
            hot = celsius >= self.profile.slowdown_c
            gpu.throttle_reasons = (gpu.throttle_reasons | _THERMAL_REASONS) if hot \
                else (gpu.throttle_reasons & ~_THERMAL_REASONS)
            gpu.sm_clock_mhz = self.profile.sm_clock_mhz // 2 if hot else self.profile.sm_clock_mhz

    def set_load(self, index: int, utilization_percent: int, memory_used_mib: int) -> None:
        with self._lock:
            gpu = self._by_index(index)
            gpu.utilization_percent = utilization_percent
            gpu.memory_used_mib = memory_used_mib

    def set_mig_mode(self, index: int, enabled: bool) -> None:
        with self._lock:
            self._by_index(index).mig_mode = int(enabled)

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
