"""Fault injection on simulated GPUs: changes the fake hardware, then records the verdict of the policy.

Only in simulated mode; on real hardware every injection is refused. The verdict is recorded here
directly because issue 2 has no XID event reader yet; once issue 3's reader watches the fake's event
set, injection only touches the fake and the reader does the rest (one path for real and fake).
"""

from __future__ import annotations

from trainyard_core.errors import FailedPrecondition, InvalidArgument

from ..model import Accelerator
from ..nvml.fake import FakeNvml
from . import policy
from .book import HealthBook

KINDS = ("xid", "ecc", "fall_off_bus", "thermal")


class FaultInjector:
    def __init__(self, fake: FakeNvml | None, book: HealthBook) -> None:
        self._fake = fake
        self._book = book

    def inject(self, gpu_index: int, kind: str, *, xid: int = 0, count: int = 0) -> Accelerator:
        """Apply a fault to GPU `gpu_index`; returns the GPU as it is afterwards.

        Kinds: "xid" (needs `xid`; per the XID table), "fall_off_bus" (XID 79: every NVML call on the GPU
        fails from now on), "ecc" (`count` more uncorrectable errors, default 1), "thermal" (`count` is the
        temperature in °C, default a few degrees above the slowdown threshold).
        """
        if self._fake is None:
            raise FailedPrecondition("fault injection is only available on simulated GPUs (start the agent "
                                     "with --gpu-profile); this agent reads real hardware through NVML")
        if not 0 <= gpu_index < len(self._book):
            raise InvalidArgument(f"gpu_index {gpu_index} does not exist on this node "
                                  f"(it has {len(self._book)} GPUs)")
        if kind == "xid":
            if xid <= 0:
                raise InvalidArgument("kind 'xid' needs a positive xid (e.g. 79, 48, 13)")
            self._fake.inject_xid(gpu_index, xid)
            verdict = policy.for_xid(xid)
        elif kind == "fall_off_bus":
            self._fake.fall_off_bus(gpu_index)
            verdict = policy.for_lost("fault injected")
        elif kind == "ecc":
            total = self._fake.add_ecc_errors(gpu_index, max(count, 1))
            verdict = policy.for_ecc(total)
        elif kind == "thermal":
            celsius = count if count > 0 else policy.THERMAL_SLOWDOWN_C + 5
            self._fake.set_temperature(gpu_index, celsius)
            verdict = policy.for_temperature(celsius)
        else:
            raise InvalidArgument(f"unknown fault kind {kind!r}; use one of {', '.join(KINDS)}")
        self._book.report(gpu_index, verdict.health, verdict.reason)
        return self._book.get(gpu_index)
