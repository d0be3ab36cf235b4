"""Polls GPU metrics at a fixed interval and turns what the poll reveals into health findings.

NVML calls block, so each poll runs in a worker thread; the findings are applied on the event loop.
Runs whether or not the scheduler is reachable: health is tracked locally and pushed once connected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from ..metrics import publish_gpu_metrics
from ..model import AcceleratorMetrics
from ..nvml.adapter import MetricsSample, NvmlAdapter
from . import policy
from .book import HealthBook

log = logging.getLogger(__name__)


class GpuMonitor:
    def __init__(self, adapter: NvmlAdapter, book: HealthBook, *, node_id: str, interval_s: float) -> None:
        self._adapter = adapter
        self._book = book
        self._node_id = node_id
        self.interval_s = interval_s
        self.latest: list[AcceleratorMetrics] = []
        self._task: asyncio.Task[None] | None = None

    async def poll_once(self) -> MetricsSample:
        sample = await asyncio.to_thread(self._adapter.metrics)
        self.apply(sample)
        return sample

    def apply(self, sample: MetricsSample) -> None:
        self.latest = sample.metrics
        for index, detail in sample.lost.items():
            verdict = policy.for_lost(detail)
            self._book.report(index, verdict.health, verdict.reason)
        for m in sample.metrics:
            verdict = policy.for_temperature(m.temperature_c)
            self._book.report(m.index, verdict.health, verdict.reason)
        publish_gpu_metrics(self._node_id, sample.metrics, self._book.all())

    def start(self) -> None:
        if len(self._book) and self._task is None:
            self._task = asyncio.create_task(self._run(), name="gpu-monitor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            try:
                await self.poll_once()
            except Exception:
                # A failing poll must not end monitoring; the next one may succeed.
                log.exception("GPU metrics poll failed")
            next_at += self.interval_s
            await asyncio.sleep(max(0.0, next_at - loop.time()))
