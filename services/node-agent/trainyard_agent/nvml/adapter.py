"""The one place that calls NVML.

`NvmlAdapter` takes a module with pynvml's API: the real `pynvml` (nvidia-ml-py) or `FakeNvml`. The
functions it may call are listed in `NvmlModule`; the fake implements exactly those with pynvml's names,
arguments and return shapes, so the code below runs unchanged in tests and in simulated clusters.

Calls are blocking C calls (a wedged GPU can stall one for seconds): the monitor runs `metrics()` in a
worker thread. Issue 3 extends this adapter with health counters (ECC, remapped rows, NVLink, PCIe
replay), XID event sets and topology; each gets its own reader method here and its own functions in
`NvmlModule`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, TypeVar

from trainyard_core.errors import FailedPrecondition

from ..model import Accelerator, AcceleratorMetrics, Health, Inventory, Vendor, normalise_model
from .profiles import PROFILES

log = logging.getLogger(__name__)
T = TypeVar("T")

# pynvml constants the adapter uses; fixed by the NVML ABI.
NVML_TEMPERATURE_GPU = 0
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_NO_PERMISSION = 4


class NvmlModule(Protocol):
    """The subset of pynvml the agent calls. Keep `FakeNvml` and tests/agent's signature check in step."""

    NVMLError: type[Exception]

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlSystemGetDriverVersion(self) -> str: ...
    def nvmlSystemGetCudaDriverVersion(self) -> int: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetName(self, handle: Any) -> str: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str: ...
    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Any = None) -> Any: ...
    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]: ...
    def nvmlDeviceGetNumaNodeId(self, handle: Any) -> int: ...
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any: ...
    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int: ...
    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int: ...


class NvmlUnavailable(FailedPrecondition):
    """NVML cannot be used on this host; the agent cannot start in real-hardware mode."""


@dataclass
class MetricsSample:
    """One poll of every GPU. `lost` holds GPUs that stopped answering, with the reason NVML gave."""

    metrics: list[AcceleratorMetrics] = field(default_factory=list)
    lost: dict[int, str] = field(default_factory=dict)


def _text(value: Any) -> str:
    # pynvml decodes most strings, but struct fields may come back as bytes depending on the version.
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)


def _error_code(exc: BaseException) -> int:
    return int(getattr(exc, "value", -1))


class NvmlAdapter:
    """Reads inventory and metrics. Not thread-safe across `open`/`close`; `metrics` may run in a thread."""

    def __init__(self, nvml: NvmlModule, vendor: Vendor = Vendor.NVIDIA) -> None:
        self._nvml = nvml
        self._vendor = vendor
        self._handles: list[Any] = []
        # GPUs whose handle NVML could not give, with its error.
        self._broken: dict[int, str] = {}
        self._open = False

    @property
    def vendor(self) -> Vendor:
        return self._vendor

    def open(self) -> None:
        try:
            self._nvml.nvmlInit()
        except self._nvml.NVMLError as exc:
            raise NvmlUnavailable(_explain_init_error(exc)) from exc
        self._open = True
        try:
            count = self._nvml.nvmlDeviceGetCount()
        except self._nvml.NVMLError as exc:
            self.close()
            raise NvmlUnavailable(f"NVML cannot count this host's GPUs: {type(exc).__name__}: {exc}") from exc
        self._handles = []
        self._broken = {}
        for index in range(count):
            try:
                self._handles.append(self._nvml.nvmlDeviceGetHandleByIndex(index))
            except self._nvml.NVMLError as exc:
                # One bad GPU must not keep the agent (and the node's healthy GPUs) from serving.
                self._handles.append(None)
                self._broken[index] = f"NVML error {type(exc).__name__}: {exc}"

    def close(self) -> None:
        if self._open:
            self._open = False
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError as exc:
                log.warning("nvmlShutdown failed: %s", exc)

    def inventory(self) -> Inventory:
        """Every GPU NVML counts. A GPU that fails to answer is listed UNHEALTHY with NVML's error, so
        the scheduler sees it and never places work on it."""
        n = self._nvml
        driver = self._optional(n.nvmlSystemGetDriverVersion, "")
        cuda = self._optional(n.nvmlSystemGetCudaDriverVersion, 0)
        runtime = f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else ""
        accelerators = []
        for index, handle in enumerate(self._handles):
            reason = self._broken.get(index, "")
            if not reason:
                try:
                    accelerators.append(self._describe(index, handle))
                    continue
                except n.NVMLError as exc:
                    reason = f"NVML error {type(exc).__name__}: {exc}"
            accelerators.append(Accelerator(index=index, uuid="", vendor=self._vendor, model="unknown",
                                            name="unknown", memory_mb=0, pci_bus_id="", capability="",
                                            health=Health.UNHEALTHY, health_reason=reason))
        return Inventory(vendor=self._vendor, driver_version=_text(driver), accelerators=tuple(accelerators),
                         runtime_version=runtime)

    def _describe(self, index: int, handle: Any) -> Accelerator:
        n = self._nvml
        name = _text(n.nvmlDeviceGetName(handle))
        pci = n.nvmlDeviceGetPciInfo(handle)
        memory = n.nvmlDeviceGetMemoryInfo(handle)
        major, minor = n.nvmlDeviceGetCudaComputeCapability(handle)
        numa = self._optional(partial(n.nvmlDeviceGetNumaNodeId, handle), -1)
        return Accelerator(
            index=index,
            uuid=_text(n.nvmlDeviceGetUUID(handle)),
            vendor=self._vendor,
            model=normalise_model(name),
            name=name,
            memory_mb=int(memory.total) // (1024 * 1024),
            pci_bus_id=_text(pci.busId),
            capability=f"{major}.{minor}",
            numa_node=int(numa),
        )

    def metrics(self) -> MetricsSample:
        sample = MetricsSample()
        n = self._nvml
        for index, handle in enumerate(self._handles):
            if handle is None:
                sample.lost[index] = self._broken[index]
                continue
            try:
                util = self._optional(partial(_utilization, n, handle), 0)
                used = int(n.nvmlDeviceGetMemoryInfo(handle).used) // (1024 * 1024)
                temp = self._optional(partial(n.nvmlDeviceGetTemperature, handle, NVML_TEMPERATURE_GPU), 0)
                power_mw = self._optional(partial(n.nvmlDeviceGetPowerUsage, handle), 0)
            except n.NVMLError as exc:
                # A GPU that fell off the bus answers every call with GPU_IS_LOST (XID 79's symptom).
                sample.lost[index] = f"NVML error {type(exc).__name__}: {exc}"
                continue
            sample.metrics.append(AcceleratorMetrics(index=index, utilization_percent=int(util),
                                                     memory_used_mb=used, temperature_c=int(temp),
                                                     power_w=int(power_mw) // 1000))
        return sample

    def _optional(self, call: Callable[[], T], default: T) -> T:
        """Fields some GPUs or drivers do not support are reported as `default`, not as a failure."""
        try:
            return call()
        except self._nvml.NVMLError as exc:
            if _error_code(exc) in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_NO_PERMISSION):
                return default
            raise


def _utilization(nvml: NvmlModule, handle: Any) -> int:
    return int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)


def _explain_init_error(exc: BaseException) -> str:
    code = _error_code(exc)
    hint = ("To run this agent without GPUs, simulate them with --gpu-profile NAME "
            f"(env TRAINYARD_AGENT_GPU_PROFILE); profiles: {', '.join(sorted(PROFILES))}.")
    if code == NVML_ERROR_LIBRARY_NOT_FOUND:
        return ("NVML is not available: libnvidia-ml.so.1 was not found (NVMLError_LibraryNotFound), so this "
                f"host has no NVIDIA driver installed. {hint}")
    if code == NVML_ERROR_DRIVER_NOT_LOADED:
        return ("NVML is installed but the NVIDIA kernel driver is not loaded (NVMLError_DriverNotLoaded); "
                f"check `nvidia-smi` and the driver. {hint}")
    return f"cannot initialise NVML: {type(exc).__name__}: {exc}. {hint}"
