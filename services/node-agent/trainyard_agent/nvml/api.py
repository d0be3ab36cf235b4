"""The subset of pynvml (nvidia-ml-py) the agent calls, and the NVML constants it uses.

`NvmlModule` lists every function `NvmlAdapter` and `NvmlEventSource` may call, with pynvml's parameter
names; `FakeNvml` implements exactly these (tests/agent checks all three signatures against pynvml).
Constants are fixed by the NVML ABI; they are repeated here so the adapter does not import pynvml (the
module it reads from is passed in).
"""

from __future__ import annotations

from typing import Any, Protocol


class NvmlModule(Protocol):
    """The subset of pynvml the agent calls. Keep `FakeNvml` and tests/agent's signature check in step."""

    NVMLError: type[Exception]

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlSystemGetDriverVersion(self) -> str: ...
    def nvmlSystemGetCudaDriverVersion(self) -> int: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    # inventory
    def nvmlDeviceGetName(self, handle: Any) -> str: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str: ...
    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Any = None) -> Any: ...
    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]: ...
    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]: ...
    # topology
    def nvmlDeviceGetNumaNodeId(self, handle: Any) -> int: ...
    def nvmlDeviceGetCpuAffinity(self, handle: Any, cpuSetSize: int) -> Any: ...
    def nvmlDeviceGetNvLinkState(self, device: Any, link: int) -> int: ...
    def nvmlDeviceGetNvLinkRemotePciInfo(self, device: Any, link: int) -> Any: ...
    def nvmlDeviceGetTopologyCommonAncestor(self, device1: Any, device2: Any) -> int: ...
    # live metrics
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any: ...
    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int: ...
    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int: ...
    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int: ...
    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int: ...
    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int: ...
    # health counters
    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int: ...
    def nvmlDeviceGetRemappedRows(self, device: Any) -> tuple[int, int, int, int]: ...
    def nvmlDeviceGetRetiredPages(self, device: Any, sourceFilter: int) -> list[int]: ...
    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: Any) -> int: ...
    def nvmlDeviceGetNvLinkErrorCounter(self, device: Any, link: int, counter: int) -> int: ...
    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> int: ...
    # events
    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int: ...
    def nvmlEventSetCreate(self) -> Any: ...
    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None: ...
    def nvmlEventSetWait(self, eventSet: Any, timeoutms: int) -> Any: ...
    def nvmlEventSetFree(self, eventSet: Any) -> None: ...


# Return codes (NVMLError.value).
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15

NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_FEATURE_ENABLED = 1

NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1

NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0
NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1

# nvmlNvLinkErrorCounter_t: DL replay, DL recovery, CRC flit, CRC data, ECC data.
NVML_NVLINK_ERROR_COUNTERS = (0, 1, 2, 3, 4)
NVML_NVLINK_MAX_LINKS = 36

# nvmlGpuTopologyLevel_t, and the names nvidia-smi topo -m uses for them.
NVML_TOPOLOGY_INTERNAL = 0
NVML_TOPOLOGY_SINGLE = 10
NVML_TOPOLOGY_MULTIPLE = 20
NVML_TOPOLOGY_HOSTBRIDGE = 30
NVML_TOPOLOGY_NODE = 40
NVML_TOPOLOGY_SYSTEM = 50
TOPOLOGY_LEVEL_NAMES = {
    # Two GPUs on one board (dual-GPU cards): closer than a shared switch; PIX is the closest name there is.
    NVML_TOPOLOGY_INTERNAL: "PIX",
    NVML_TOPOLOGY_SINGLE: "PIX",
    NVML_TOPOLOGY_MULTIPLE: "PXB",
    NVML_TOPOLOGY_HOSTBRIDGE: "PHB",
    NVML_TOPOLOGY_NODE: "NODE",
    NVML_TOPOLOGY_SYSTEM: "SYS",
}

# nvmlEventType* bits the agent registers for.
EVENT_SINGLE_BIT_ECC = 0x0001
EVENT_DOUBLE_BIT_ECC = 0x0002
EVENT_XID_CRITICAL = 0x0008
EVENT_DRAM_RETIREMENT = 0x0400
EVENT_DRAM_RETIREMENT_FAILURE = 0x0800
WANTED_EVENTS = EVENT_XID_CRITICAL | EVENT_DOUBLE_BIT_ECC | EVENT_DRAM_RETIREMENT | EVENT_DRAM_RETIREMENT_FAILURE

# nvmlClocksEventReason* bits by the names the agent reports; idle is not a slowdown and is left out.
THROTTLE_REASONS = {
    0x0002: "applications_clocks",
    0x0004: "sw_power_cap",
    0x0008: "hw_slowdown",
    0x0010: "sync_boost",
    0x0020: "sw_thermal",
    0x0040: "hw_thermal",
    0x0080: "hw_power_brake",
    0x0100: "display_clocks",
}
