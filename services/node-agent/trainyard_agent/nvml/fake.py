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
from typing import Any

import pynvml

from .fake_controls import FaultControls
from .fake_devices import (
    _MIB,
    _PCI_DEVICE_IDS,
    _SUPPORTED_EVENTS,
    _SWITCH_BUS_BASE,
    FakeGpu,
    _address,
    _error,
    _EventSet,
    _opaque,
)
from .profiles import common_ancestor
from .topology import mask_from_cpus

__all__ = ["FakeGpu", "FakeNvml"]


class FakeNvml(FaultControls):
    """A pynvml-compatible module object driven by a hardware profile (the devices: fake_devices.py; the fault
    controls: fake_controls.py)."""

    NVMLError = pynvml.NVMLError
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU

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
