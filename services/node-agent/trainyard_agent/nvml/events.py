"""XIDs and memory-error events through an NVML event set.

`nvmlEventSetCreate` once, `nvmlDeviceRegisterEvents` per GPU for the event types it supports (XID
critical errors, double-bit ECC, DRAM retirement and its failure), then `nvmlEventSetWait` with a timeout
from one dedicated thread (see health/monitor.py): the wait blocks in the driver, so it must never run on
the event loop, and the timeout lets that thread notice it is asked to stop.

The event's device is matched to a GPU index by its handle's address (handles are pointers to the
driver's device structures; the fake NVML hands out real ctypes pointers too), never by calling NVML on
it: the GPU behind an XID 79 event no longer answers.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

from ..backend import DeviceEvent, EventKind
from . import api
from .api import NvmlModule

log = logging.getLogger(__name__)

# After the first event of a wait, at most this many more that are already queued join the same batch.
_BATCH = 64

_KINDS = {
    api.EVENT_XID_CRITICAL: EventKind.XID,
    api.EVENT_DOUBLE_BIT_ECC: EventKind.ECC_UNCORRECTED,
    api.EVENT_DRAM_RETIREMENT: EventKind.MEMORY_RETIREMENT,
    api.EVENT_DRAM_RETIREMENT_FAILURE: EventKind.MEMORY_RETIREMENT_FAILURE,
}


def handle_address(handle: Any) -> int | None:
    """The address a device handle points at, or None for something that is not a pointer."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None


class NvmlEventSource:
    """An NVML event set over every GPU that supports one of the wanted event types. One thread calls
    `wait`; `close` frees the set once that thread has returned."""

    def __init__(self, nvml: NvmlModule, handles: list[Any]) -> None:
        self._nvml = nvml
        self._handles = handles
        self._index_by_address: dict[int, int] = {}
        self._set: Any = None
        self.registered: dict[int, int] = {}

    def open(self) -> bool:
        """Create the set and register the GPUs; False when no GPU offers any wanted event."""
        n = self._nvml
        for index, handle in enumerate(self._handles):
            address = handle_address(handle) if handle is not None else None
            if address is not None:
                self._index_by_address[address] = index
        if not self._index_by_address:
            return False
        try:
            self._set = n.nvmlEventSetCreate()
        except n.NVMLError as exc:
            log.warning("no NVML event set (XIDs are not watched; health comes from polling only): %s", exc)
            return False
        for index, handle in enumerate(self._handles):
            if handle is None:
                continue
            try:
                mask = int(n.nvmlDeviceGetSupportedEventTypes(handle)) & api.WANTED_EVENTS
                if mask:
                    n.nvmlDeviceRegisterEvents(handle, mask, self._set)
                    self.registered[index] = mask
            except n.NVMLError as exc:
                log.warning("GPU %d: cannot register for NVML events: %s", index, exc)
        if not self.registered:
            self.close()
            return False
        return True

    def wait(self, timeout_s: float) -> list[DeviceEvent]:
        """Events that arrived within `timeout_s`. Raises NVMLError for anything but a timeout (the caller
        backs off: a set whose GPU is lost can answer GPU_IS_LOST at once, every time)."""
        n = self._nvml
        events: list[DeviceEvent] = []
        timeout_ms = max(0, int(timeout_s * 1000))
        while len(events) <= _BATCH:
            try:
                data = n.nvmlEventSetWait(self._set, timeout_ms)
            except n.NVMLError as exc:
                if int(getattr(exc, "value", -1)) == api.NVML_ERROR_TIMEOUT:
                    return events
                if events:
                    return events
                raise
            event = self._convert(data)
            if event is not None:
                events.append(event)
            timeout_ms = 0  # drain what is already queued, without waiting again
        return events

    def _convert(self, data: Any) -> DeviceEvent | None:
        address = handle_address(data.device)
        index = self._index_by_address.get(address) if address is not None else None
        kind = _KINDS.get(int(data.eventType))
        if index is None or kind is None:
            log.warning("NVML event for an unknown device or of an unexpected type",
                        extra={"event_type": int(data.eventType), "event_data": int(data.eventData)})
            return None
        return DeviceEvent(index=index, kind=kind, code=int(data.eventData) if kind is EventKind.XID else 0)

    def close(self) -> None:
        if self._set is not None:
            try:
                self._nvml.nvmlEventSetFree(self._set)
            except self._nvml.NVMLError as exc:
                log.warning("nvmlEventSetFree failed: %s", exc)
            self._set = None
