"""Watches the GPUs: polls metrics and counters, listens for device events, and turns both into findings.

Two activities, neither blocking the event loop:
- a poll every `interval_s` (the heartbeat interval, 1 s by default) in a worker thread: utilization,
  memory, temperature, power, clocks, throttle reasons; the error counters (ECC, memory repair, NVLink,
  PCIe) every `counters_interval_s`, or at once when an event says they moved. Results are applied on the
  loop: lost GPUs, thermal state and counter thresholds become findings in the health book;
- one thread blocked in the backend's event wait (with a timeout, so it notices when asked to stop). Each
  batch of events is handed to the loop: an XID becomes a sticky finding per the policy (an application
  XID only a log line), a memory event triggers a counter read.

Health is tracked whether or not the scheduler is reachable; the reporter pushes changes once connected.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from dataclasses import replace

from trainyard_core.waits import cancel_and_wait

from ..backend import AcceleratorBackend, DeviceEvent, EventKind, EventSource, Sample
from ..gpu_history import GpuHistory
from ..metrics import count_xid, forget_node, publish_gpu_metrics
from ..model import AcceleratorMetrics, Health, HealthCounters
from ..notify import Notifier
from .book import HealthBook
from .policy import HealthPolicy

log = logging.getLogger(__name__)

# How long one event wait blocks before the thread checks whether it should stop.
EVENT_WAIT_S = 0.25
# Pause after a failed event wait (a set whose GPU is lost may fail at once, every time).
EVENT_RETRY_S = 1.0


class GpuMonitor:
    def __init__(self, backend: AcceleratorBackend, book: HealthBook, policy: HealthPolicy, *, node_id: str,
                 interval_s: float, counters_interval_s: float = 10.0, history: GpuHistory | None = None,
                 hostname: str = "") -> None:
        self._backend = backend
        # Told every poll and XID: the recent past the console charts (gpu_history.py).
        self._history = history
        self._book = book
        self._policy = policy
        self._node_id = node_id
        # The metrics' `Hostname` label (metrics.metrics_hostname); the node id when not given.
        self._hostname = hostname or node_id
        self.interval_s = interval_s
        self.counters_interval_s = counters_interval_s
        self.latest: list[AcceleratorMetrics] = []
        self.counters: dict[int, HealthCounters] = {}
        # XID events applied per GPU, and a wake-up for whoever waits on them (fault injection).
        self.xids_seen: dict[int, int] = {}
        self.events_applied = Notifier()
        self._task: asyncio.Task[None] | None = None
        self._side_tasks: set[asyncio.Task[None]] = set()
        self._events: EventSource | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._counters_due = True
        self._loop: asyncio.AbstractEventLoop | None = None

    # --- polling -----------------------------------------------------------------------------------------

    async def poll_once(self, *, counters: bool = True) -> Sample:
        sample = await asyncio.to_thread(self._backend.sample, counters=counters)
        self.apply(sample)
        return sample

    def apply(self, sample: Sample) -> None:
        self.counters.update(sample.counters)
        self.latest = [replace(m, counters=self.counters.get(m.index, HealthCounters())) for m in sample.metrics]
        answered = {m.index for m in sample.metrics}
        for index in range(len(self._book)):
            if index in sample.lost:
                self._book.set_finding(index, "lost", self._policy.lost(sample.lost[index]))
            elif index in answered:
                self._book.set_finding(index, "lost", None)
        for m in sample.metrics:
            flagged = "thermal" in self._book.findings(m.index)
            self._book.set_finding(m.index, "thermal",
                                   self._policy.thermal(m.temperature_c, m.throttle_reasons, flagged=flagged))
        for index, counts in sample.counters.items():
            for source, verdict in self._policy.counters(counts.since(self._book.baseline(index))).items():
                self._book.set_finding(index, source, verdict)
        publish_gpu_metrics(self._node_id, self._hostname, self.latest, self._book.all())
        if self._history is not None:
            self._history.record(self.latest, self._book.all())

    def start(self) -> None:
        if not len(self._book) or self._task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name="gpu-monitor")
        self._events = self._backend.events()
        if self._events is not None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._read_events, name="gpu-events", daemon=True)
            self._thread.start()
        else:
            log.warning("no device events: XIDs are not seen, health comes from polling only")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        for task in list(self._side_tasks):
            await cancel_and_wait(task)
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        if self._events is not None:
            self._events.close()
            self._events = None
        # A stopped monitor's GPU series would only go stale.
        forget_node(self._node_id)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        counters_at = loop.time()
        while True:
            try:
                now = loop.time()
                due = self._counters_due or now >= counters_at
                if due:
                    self._counters_due = False
                    counters_at = now + self.counters_interval_s
                await self.poll_once(counters=due)
            except Exception:
                # A failing poll must not end monitoring; the next one may succeed.
                log.exception("GPU poll failed")
            next_at += self.interval_s
            await asyncio.sleep(max(0.0, next_at - loop.time()))

    # --- events ------------------------------------------------------------------------------------------

    def _read_events(self) -> None:
        """The event thread: wait, hand each batch to the loop, until stopped."""
        assert self._events is not None and self._loop is not None
        while not self._stop.is_set():
            try:
                events = self._events.wait(EVENT_WAIT_S)
            except Exception as exc:
                log.warning("waiting for GPU events failed; retrying: %s", exc)
                self._stop.wait(EVENT_RETRY_S)
                continue
            if events:
                try:
                    self._loop.call_soon_threadsafe(self.apply_events, events)
                except RuntimeError:
                    return  # the loop is closed: the agent is shutting down

    def apply_events(self, events: Sequence[DeviceEvent]) -> None:
        read_counters = False
        for event in events:
            if not 0 <= event.index < len(self._book):
                continue
            if event.kind is EventKind.XID:
                verdict = self._policy.xid(event.code)
                log.log(logging.INFO if verdict.health is Health.HEALTHY else logging.WARNING, "XID on GPU %d",
                        event.index, extra={"gpu": event.index, "xid": event.code, "action": verdict.action.value,
                                            "health": verdict.health.name, "reason": verdict.reason})
                self._book.add_event(event.index, verdict)
                count_xid(self._node_id, event.index, event.code)
                if self._history is not None:
                    self._history.xid(event.index, event.code, verdict)
                self.xids_seen[event.index] = self.xids_seen.get(event.index, 0) + 1
            else:
                log.info("GPU memory error event", extra={"gpu": event.index, "event": event.kind.value})
                read_counters = True
        # The health an XID changed is on /metrics now, not at the next poll.
        publish_gpu_metrics(self._node_id, self._hostname, self.latest, self._book.all())
        if read_counters:
            if self._task is not None:
                # Read the counters now rather than at the next tick: the event says they changed.
                task = asyncio.get_running_loop().create_task(self._poll_counters_now())
                self._side_tasks.add(task)
                task.add_done_callback(self._side_tasks.discard)
            else:
                self._counters_due = True
        self.events_applied.notify()

    async def _poll_counters_now(self) -> None:
        try:
            await self.poll_once(counters=True)
        except Exception:
            log.exception("GPU counter read after an event failed")
