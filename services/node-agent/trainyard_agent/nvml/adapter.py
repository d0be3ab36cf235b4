"""The one place that calls NVML: `NvmlAdapter`, the agent's `AcceleratorBackend` over NVML.

It takes a module with pynvml's API: the real `pynvml` (nvidia-ml-py) or `FakeNvml`. The functions it may
call are listed in `api.NvmlModule`; the fake implements exactly those with pynvml's names, arguments and
return shapes, so the code below runs unchanged in tests and in simulated clusters.

What it reads:
- inventory (once): name, UUID, PCI bus id, memory, compute capability, MIG mode, driver and CUDA version;
  topology: NUMA node, CPU affinity, NVLink state and far ends (→ islands, NVLinks per pair), and the
  closest common PCIe ancestor of every GPU pair (→ PIX/PXB/PHB/NODE/SYS);
- metrics (every poll): utilization, memory used, temperature, power, SM and memory clocks, throttle
  reasons; health counters (when asked): ECC (volatile and aggregate), remapped rows or retired pages,
  NVLink error counters, PCIe replays;
- events: XIDs and ECC/retirement events through an NVML event set (`events.py`).

A field a GPU or driver does not support is reported as its default, and the call is not made again for
that GPU (a host polled every second should not pay for errors). Any other NVML error while polling a GPU
marks it lost for that poll: a GPU that fell off the bus answers everything with GPU_IS_LOST.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any, TypeVar

from trainyard_core.errors import FailedPrecondition

from ..backend import Sample
from ..model import (
    Accelerator,
    AcceleratorMetrics,
    GpuLink,
    Health,
    HealthCounters,
    Inventory,
    Vendor,
    normalise_model,
)
from . import api
from .api import NvmlModule
from .events import NvmlEventSource
from .profiles import PROFILES
from .topology import PciKey, cpus_from_mask, nvlink_islands, nvlinks_between

log = logging.getLogger(__name__)
T = TypeVar("T")

# Codes that mean "this GPU or driver does not offer that": the field is left at its default.
_UNSUPPORTED = (api.NVML_ERROR_NOT_SUPPORTED, api.NVML_ERROR_NO_PERMISSION, api.NVML_ERROR_FUNCTION_NOT_FOUND,
                api.NVML_ERROR_NOT_FOUND)

__all__ = ["NvmlAdapter", "NvmlModule", "NvmlUnavailable", "Sample"]


class NvmlUnavailable(FailedPrecondition):
    """NVML cannot be used on this host; the agent cannot start in real-hardware mode."""


def _text(value: Any) -> str:
    # pynvml decodes most strings, but struct fields may come back as bytes depending on the version.
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)


def _error_code(exc: BaseException) -> int:
    return int(getattr(exc, "value", -1))


def _pci_key(info: Any) -> PciKey:
    return int(info.domain), int(info.bus), int(info.device)


class NvmlAdapter:
    """Reads inventory, metrics and counters: `open`, `inventory` once (it finds the active NVLinks whose
    error counters `sample` reads), then `sample` as often as needed. Not thread-safe across `open`/`close`;
    `sample` may run in a worker thread while the event source waits in another."""

    def __init__(self, nvml: NvmlModule, vendor: Vendor = Vendor.NVIDIA, *, host_cpus: int | None = None) -> None:
        self._nvml = nvml
        self._vendor = vendor
        # nvmlDeviceGetCpuAffinity wants the size of the CPU set in 64-bit words: enough for every CPU.
        self._cpu_words = max(1, ((host_cpus or os.cpu_count() or 1) + 63) // 64)
        self._handles: list[Any] = []
        # GPUs whose handle NVML could not give, with its error.
        self._broken: dict[int, str] = {}
        # (gpu, field) pairs NVML said it does not support: not asked again.
        self._unsupported: set[tuple[int, str]] = set()
        # Active NVLink links per GPU, read with the topology: the error counters are read on those only.
        self._active_links: dict[int, list[int]] = {}
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

    def events(self) -> NvmlEventSource | None:
        source = NvmlEventSource(self._nvml, self._handles)
        return source if source.open() else None

    # --- inventory and topology --------------------------------------------------------------------------

    def inventory(self) -> Inventory:
        """Every GPU NVML counts, and how they are connected. A GPU that fails to answer is listed UNHEALTHY
        with NVML's error, so the scheduler sees it and never places work on it."""
        n = self._nvml
        driver = self._optional(-1, "driver", n.nvmlSystemGetDriverVersion, "")
        cuda = self._optional(-1, "cuda", n.nvmlSystemGetCudaDriverVersion, 0)
        runtime = f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else ""
        described: list[Accelerator] = []
        pci: dict[int, PciKey] = {}
        for index, handle in enumerate(self._handles):
            reason = self._broken.get(index, "")
            if not reason:
                try:
                    gpu, pci[index] = self._describe(index, handle)
                    described.append(gpu)
                    continue
                except n.NVMLError as exc:
                    reason = f"NVML error {type(exc).__name__}: {exc}"
            described.append(Accelerator(index=index, uuid="", vendor=self._vendor, model="unknown",
                                         name="unknown", memory_mb=0, pci_bus_id="", capability="",
                                         health=Health.UNHEALTHY, health_reason=reason))
        readable = sorted(pci)
        remotes = {i: self._nvlink_remotes(i) for i in readable}
        self._active_links = {i: [link for link, _ in ends] for i, ends in remotes.items()}
        keys = [pci[i] for i in readable]
        ends = [[end for _, end in remotes[i]] for i in readable]
        islands = dict(zip(readable, nvlink_islands(keys, ends), strict=True))
        links = []
        for a_pos, a in enumerate(readable):
            for b_pos in range(a_pos + 1, len(readable)):
                b = readable[b_pos]
                level = self._common_ancestor(a, b)
                if level is None:
                    continue
                links.append(GpuLink(a, b, level, nvlinks_between(keys, ends, a_pos, b_pos)))
        accelerators = tuple(replace(g, nvlink_island=islands.get(g.index, -1)) for g in described)
        return Inventory(vendor=self._vendor, driver_version=_text(driver), accelerators=accelerators,
                         runtime_version=runtime, links=tuple(links))

    def _describe(self, index: int, handle: Any) -> tuple[Accelerator, PciKey]:
        n = self._nvml
        name = _text(n.nvmlDeviceGetName(handle))
        pci = n.nvmlDeviceGetPciInfo(handle)
        memory = n.nvmlDeviceGetMemoryInfo(handle)
        major, minor = n.nvmlDeviceGetCudaComputeCapability(handle)
        numa = self._optional(index, "numa", partial(n.nvmlDeviceGetNumaNodeId, handle), -1)
        mask = self._optional(index, "cpu_affinity", partial(n.nvmlDeviceGetCpuAffinity, handle, self._cpu_words),
                              None)
        mig = self._optional(index, "mig", partial(n.nvmlDeviceGetMigMode, handle), None)
        gpu = Accelerator(
            index=index,
            uuid=_text(n.nvmlDeviceGetUUID(handle)),
            vendor=self._vendor,
            model=normalise_model(name),
            name=name,
            memory_mb=int(memory.total) // (1024 * 1024),
            pci_bus_id=_text(pci.busId),
            capability=f"{major}.{minor}",
            numa_node=int(numa),
            cpu_affinity=cpus_from_mask(mask) if mask is not None else (),
            mig_enabled=bool(mig is not None and int(mig[0]) == api.NVML_FEATURE_ENABLED),
        )
        return gpu, _pci_key(pci)

    def _nvlink_remotes(self, index: int) -> list[tuple[int, PciKey]]:
        """(link, far end) for each active NVLink of GPU `index`; empty for a PCIe-only GPU."""
        n = self._nvml
        handle = self._handles[index]
        out: list[tuple[int, PciKey]] = []
        for link in range(api.NVML_NVLINK_MAX_LINKS):
            try:
                active = n.nvmlDeviceGetNvLinkState(handle, link)
                if active != api.NVML_FEATURE_ENABLED:
                    continue
                out.append((link, _pci_key(n.nvmlDeviceGetNvLinkRemotePciInfo(handle, link))))
            except n.NVMLError as exc:
                # Past the GPU's last link NVML answers INVALID_ARGUMENT; a GPU without NVLink NOT_SUPPORTED.
                if _error_code(exc) not in (*_UNSUPPORTED, api.NVML_ERROR_INVALID_ARGUMENT):
                    log.warning("cannot read NVLink %d of GPU %d: %s", link, index, exc)
                break
        return out

    def _common_ancestor(self, a: int, b: int) -> str | None:
        try:
            level = self._nvml.nvmlDeviceGetTopologyCommonAncestor(self._handles[a], self._handles[b])
        except self._nvml.NVMLError as exc:
            log.warning("cannot read the PCIe path between GPUs %d and %d: %s", a, b, exc)
            return None
        return api.TOPOLOGY_LEVEL_NAMES.get(int(level), "SYS")

    # --- metrics and counters ----------------------------------------------------------------------------

    def sample(self, *, counters: bool = True) -> Sample:
        sample = Sample()
        n = self._nvml
        for index, handle in enumerate(self._handles):
            if handle is None:
                sample.lost[index] = self._broken[index]
                continue
            try:
                sample.metrics.append(self._metrics(index, handle))
                if counters:
                    sample.counters[index] = self._counters(index, handle)
            except n.NVMLError as exc:
                # A GPU that fell off the bus answers every call with GPU_IS_LOST (XID 79's symptom).
                sample.lost[index] = f"NVML error {type(exc).__name__}: {exc}"
        return sample

    def _metrics(self, index: int, handle: Any) -> AcceleratorMetrics:
        n = self._nvml
        opt = self._optional
        util = opt(index, "utilization", partial(n.nvmlDeviceGetUtilizationRates, handle), None)
        used = int(n.nvmlDeviceGetMemoryInfo(handle).used) // (1024 * 1024)
        temp = opt(index, "temperature", partial(n.nvmlDeviceGetTemperature, handle, api.NVML_TEMPERATURE_GPU), 0)
        power_mw = opt(index, "power", partial(n.nvmlDeviceGetPowerUsage, handle), 0)
        sm = opt(index, "sm_clock", partial(n.nvmlDeviceGetClockInfo, handle, api.NVML_CLOCK_SM), 0)
        mem = opt(index, "mem_clock", partial(n.nvmlDeviceGetClockInfo, handle, api.NVML_CLOCK_MEM), 0)
        return AcceleratorMetrics(index=index, utilization_percent=int(util.gpu) if util is not None else 0,
                                  memory_used_mb=used, temperature_c=int(temp), power_w=int(power_mw) // 1000,
                                  sm_clock_mhz=int(sm), memory_clock_mhz=int(mem),
                                  throttle_reasons=self._throttle_reasons(index, handle))

    def _throttle_reasons(self, index: int, handle: Any) -> tuple[str, ...]:
        n = self._nvml
        # "Clocks event reasons" is the new name (drivers from R535); older drivers only know the old one.
        bits = self._optional(index, "clock_events", partial(n.nvmlDeviceGetCurrentClocksEventReasons, handle), None)
        if bits is None:
            bits = self._optional(index, "clock_throttle",
                                  partial(n.nvmlDeviceGetCurrentClocksThrottleReasons, handle), 0)
        return tuple(name for bit, name in api.THROTTLE_REASONS.items() if int(bits) & bit)

    def _counters(self, index: int, handle: Any) -> HealthCounters:
        n = self._nvml
        opt = self._optional

        def ecc(error: int, counter: int, key: str) -> int:
            # ECC switched off (or a part without ECC) answers NOT_SUPPORTED: no errors to count.
            return int(opt(index, key, partial(n.nvmlDeviceGetTotalEccErrors, handle, error, counter), 0))

        remapped = opt(index, "remapped_rows", partial(n.nvmlDeviceGetRemappedRows, handle), None)
        retired, retired_pending = 0, False
        if remapped is None:
            # Before Ampere, bad memory is retired page by page instead of remapped row by row.
            for cause in (api.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
                          api.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR):
                pages: list[int] = opt(index, f"retired_pages_{cause}",
                                       partial(n.nvmlDeviceGetRetiredPages, handle, cause), [])
                retired += len(pages)
            retired_pending = bool(opt(index, "retired_pending",
                                       partial(n.nvmlDeviceGetRetiredPagesPendingStatus, handle), 0))
        # By kind, in NVML_NVLINK_ERROR_COUNTERS' order: replay, recovery, CRC flit, CRC data, ECC data.
        nvlink = [0] * len(api.NVML_NVLINK_ERROR_COUNTERS)
        for link in self._active_links.get(index, ()):
            for kind, counter in enumerate(api.NVML_NVLINK_ERROR_COUNTERS):
                nvlink[kind] += int(opt(index, f"nvlink_error_{counter}",
                                        partial(n.nvmlDeviceGetNvLinkErrorCounter, handle, link, counter), 0))
        return HealthCounters(
            ecc_volatile_corrected=ecc(api.NVML_MEMORY_ERROR_TYPE_CORRECTED, api.NVML_VOLATILE_ECC, "ecc_vc"),
            ecc_volatile_uncorrected=ecc(api.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, api.NVML_VOLATILE_ECC, "ecc_vu"),
            ecc_aggregate_uncorrected=ecc(api.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, api.NVML_AGGREGATE_ECC, "ecc_au"),
            remapped_rows_pending=bool(remapped[2]) if remapped is not None else False,
            remapped_rows_failure=bool(remapped[3]) if remapped is not None else False,
            retired_pages=retired, retired_pages_pending=retired_pending, nvlink_errors=sum(nvlink),
            pcie_replays=int(opt(index, "pcie_replays", partial(n.nvmlDeviceGetPcieReplayCounter, handle), 0)),
            nvlink_replay_errors=nvlink[0], nvlink_recovery_errors=nvlink[1], nvlink_crc_flit_errors=nvlink[2],
            nvlink_crc_data_errors=nvlink[3], nvlink_ecc_data_errors=nvlink[4])

    def _optional(self, index: int, key: str, call: Callable[[], T], default: T) -> T:
        """Fields some GPUs or drivers do not support are reported as `default`, not as a failure, and not
        asked for again."""
        if (index, key) in self._unsupported:
            return default
        try:
            return call()
        except self._nvml.NVMLError as exc:
            if _error_code(exc) in _UNSUPPORTED:
                self._unsupported.add((index, key))
                return default
            raise


def _explain_init_error(exc: BaseException) -> str:
    code = _error_code(exc)
    hint = ("To run this agent without GPUs, simulate them with --gpu-profile NAME "
            f"(env TRAINYARD_AGENT_GPU_PROFILE); profiles: {', '.join(sorted(PROFILES))}.")
    if code == api.NVML_ERROR_LIBRARY_NOT_FOUND:
        return ("NVML is not available: libnvidia-ml.so.1 was not found (NVMLError_LibraryNotFound), so this "
                f"host has no NVIDIA driver installed. {hint}")
    if code == api.NVML_ERROR_DRIVER_NOT_LOADED:
        return ("NVML is installed but the NVIDIA kernel driver is not loaded (NVMLError_DriverNotLoaded); "
                f"check `nvidia-smi` and the driver. {hint}")
    return f"cannot initialise NVML: {type(exc).__name__}: {exc}. {hint}"
