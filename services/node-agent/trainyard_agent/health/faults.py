"""Fault injection on simulated GPUs: changes the fake hardware only; the agent finds out as it would on
real hardware (one path for real and fake).

- xid: the fake NVML posts an XID event; the monitor's event thread delivers it and the policy judges it.
- fall_off_bus: the GPU stops answering (NVMLError_GpuIsLost) and XID 79 is posted; the event and the next
  poll both see it.
- ecc: uncorrectable ECC counts rise and a double-bit ECC event is posted; the counters are read.
- thermal: the temperature is set; at the part's slowdown temperature the clocks drop and the throttle
  reasons say so; the metrics are polled.

`inject` returns once the agent has taken the fault in (or after `SETTLE_S`, saying so), so the answer
shows the GPU's resulting health. Only in simulated mode: on real hardware every injection is refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from trainyard_core.errors import FailedPrecondition, InvalidArgument, Unavailable

from ..model import Accelerator
from ..nvml.fake import FakeNvml
from .book import HealthBook
from .monitor import GpuMonitor

KINDS = ("xid", "ecc", "fall_off_bus", "thermal")
# How long the injection waits for the event thread to deliver an event.
SETTLE_S = 2.0
MAX_COUNT = 1_000_000


class FaultInjector:
    def __init__(self, fake: FakeNvml | None, book: HealthBook, monitor: GpuMonitor) -> None:
        self._fake = fake
        self._book = book
        self._monitor = monitor

    async def inject(self, gpu_index: int, kind: str, *, xid: int = 0, count: int = 0,
                     temperature_c: int = 0) -> Accelerator:
        """Apply a fault to GPU `gpu_index`; returns the GPU as it is afterwards.

        Kinds: "xid" (needs `xid`), "fall_off_bus", "ecc" (`count` more uncorrectable errors, default 1),
        "thermal" (`temperature_c`, default a few degrees above the part's slowdown temperature; `count` is
        accepted too, as older callers send it).
        """
        fake = self._fake
        if fake is None:
            raise FailedPrecondition("fault injection is only available on simulated GPUs (start the agent "
                                     "with --gpu-profile); this agent reads real hardware through NVML")
        if not 0 <= gpu_index < len(self._book):
            raise InvalidArgument(f"gpu_index {gpu_index} does not exist on this node "
                                  f"(it has {len(self._book)} GPUs)")
        if not 0 <= count <= MAX_COUNT:
            raise InvalidArgument(f"count must be between 0 and {MAX_COUNT}, got {count}")
        if kind == "xid":
            if not 0 < xid < 1000:
                raise InvalidArgument("kind 'xid' needs an xid between 1 and 999 (e.g. 79, 48, 13)")
            await self._until_event(gpu_index, lambda: fake.inject_xid(gpu_index, xid))
        elif kind == "fall_off_bus":
            await self._until_event(gpu_index, lambda: fake.fall_off_bus(gpu_index))
            await self._monitor.poll_once(counters=False)
        elif kind == "ecc":
            fake.add_ecc_errors(gpu_index, max(count, 1))
            await self._monitor.poll_once(counters=True)
        elif kind == "thermal":
            celsius = temperature_c or count or fake.profile.slowdown_c + 5
            if not 1 <= celsius <= 150:
                raise InvalidArgument(f"temperature_c must be between 1 and 150 °C, got {celsius}")
            fake.set_temperature(gpu_index, celsius)
            await self._monitor.poll_once(counters=False)
        else:
            raise InvalidArgument(f"unknown fault kind {kind!r}; use one of {', '.join(KINDS)}")
        return self._book.get(gpu_index)

    async def _until_event(self, gpu_index: int, post: Callable[[], None]) -> None:
        seen = self._monitor.xids_seen.get(gpu_index, 0)
        post()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SETTLE_S
        while self._monitor.xids_seen.get(gpu_index, 0) <= seen:
            left = deadline - loop.time()
            if left <= 0:
                raise Unavailable(f"the XID was injected on GPU {gpu_index} but the agent's event reader did not "
                                  f"deliver it within {SETTLE_S:g} s; is the monitor running?")
            await self._monitor.events_applied.wait(timeout=left)
