"""The one interface between the agent and a vendor's accelerator library.

`AcceleratorBackend` is what the rest of the agent (health monitor, app) uses; `nvml/adapter.py` implements
it over NVML (real, or the fake NVML of a simulated node). An AMD backend over amdsmi, or an Ascend one,
implements the same methods and produces the same `model.py` objects, so nothing above changes.

Contracts:
- `open()` before anything else, `close()` once at the end; neither is called concurrently with others.
- `inventory()` is called once at start-up (it may be slow: topology reads every GPU pair).
- `sample()` may run in a worker thread while `EventSource.wait()` blocks in another: implementations are
  thread-safe for that pair (NVML itself is).
- Calls block (a wedged GPU can stall a driver call for seconds): the agent never makes them on its event
  loop.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from .model import AcceleratorMetrics, HealthCounters, Inventory, Vendor


class EventKind(enum.StrEnum):
    """Device events a backend delivers. XID carries the XID number in `DeviceEvent.code`; the others mean
    "the error counters of this GPU changed: read them now"."""

    XID = "xid"
    ECC_UNCORRECTED = "ecc_uncorrected"
    MEMORY_RETIREMENT = "memory_retirement"
    MEMORY_RETIREMENT_FAILURE = "memory_retirement_failure"


@dataclass(frozen=True)
class DeviceEvent:
    index: int
    kind: EventKind
    code: int = 0


@dataclass
class Sample:
    """One poll of every GPU. `lost` holds GPUs that stopped answering, with the reason the driver gave;
    `counters` is filled only when the poll asked for counters."""

    metrics: list[AcceleratorMetrics] = field(default_factory=list)
    lost: dict[int, str] = field(default_factory=dict)
    counters: dict[int, HealthCounters] = field(default_factory=dict)


class EventSource(Protocol):
    """Device events as they happen. One thread waits on it; `close()` only after that thread has left
    `wait()`."""

    def wait(self, timeout_s: float) -> list[DeviceEvent]:
        """The events that arrived within `timeout_s` (an empty list when none did)."""
        ...

    def close(self) -> None: ...


class AcceleratorBackend(Protocol):
    @property
    def vendor(self) -> Vendor: ...

    def open(self) -> None:
        """Initialise the library. Raises `trainyard_core.errors.FailedPrecondition` (with what to do about
        it) when the host cannot be read at all."""
        ...

    def close(self) -> None: ...

    def inventory(self) -> Inventory: ...

    def sample(self, *, counters: bool) -> Sample: ...

    def events(self) -> EventSource | None:
        """A source of device events, or None when the device library offers none."""
        ...
