"""The fake NVML's fault and load controls (not part of pynvml): each changes what later NVML calls return
and posts the events the driver would post, to every event set registered for them (fake.py lists them)."""

from __future__ import annotations

import pynvml

from . import api
from .fake_devices import _THERMAL_REASONS, FakeDevices


class FaultControls(FakeDevices):
    """The controls a test or a simulated host calls on the fake (FakeNvml has them): by GPU index."""

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
