"""The recent past of this node's GPUs, kept in memory: a bounded ring of the monitor's polls and of the GPUs'
XIDs and health changes. The web console charts it (through the gateway's GET /v1/nodes/{id}/metrics and the
AgentService's GetGpuMetrics) so it works without a Prometheus server; Prometheus still scrapes the same
values from the agent as series when one exists.

- `record(metrics, gpus)` is called by the monitor after every poll (on the event loop): one frame of every
  GPU's utilization, memory, temperature, power and SM clock, stamped with the clock's time. A GPU whose
  (health, reason) differs from what the previous poll saw adds a "health" event.
- `xid(index, code, verdict)` is called for each XID event the monitor applies, application XIDs included (they
  change no health, but a job's owner wants to see them).
- `window(window_s, max_points)` answers the frames of the last `window_s` seconds, per GPU, averaged down to
  at most `max_points` points (a slice of the window each), and every retained event.

Memory is bounded: at most `retention_s / interval_s` frames (capped at MAX_FRAMES) and MAX_EVENTS events;
the oldest go first. Nothing is persisted: an agent restart starts an empty history (the health that matters
across restarts is in the health book's file).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from trainyard_core.clock import Clock
from trainyard_core.errors import InvalidArgument

from .health.policy import Verdict
from .model import Accelerator, AcceleratorMetrics, Health

DEFAULT_RETENTION_S = 3600.0
# A day of polls at 12 s, an hour at 0.5 s: bounded whatever the poll interval.
MAX_FRAMES = 7200
MAX_EVENTS = 512
MAX_WINDOW_S = 86_400
MAX_POINTS = 10_000


@dataclass(frozen=True, slots=True)
class GpuPoint:
    """One GPU at one time (or the mean of several polls, stamped with the last one's time)."""

    time_ms: int
    utilization_percent: float
    memory_used_mb: float
    temperature_c: float
    power_w: float
    sm_clock_mhz: float


@dataclass(frozen=True, slots=True)
class GpuEvent:
    time_ms: int
    gpu: int
    kind: str  # "xid" or "health"
    health: Health
    reason: str
    xid: int = 0


@dataclass(frozen=True, slots=True)
class HistoryWindow:
    gpus: dict[int, list[GpuPoint]]
    events: list[GpuEvent]
    interval_s: float
    retained_since_ms: int  # 0: nothing recorded yet
    now_ms: int


@dataclass(frozen=True, slots=True)
class _Frame:
    time_ms: int
    points: tuple[tuple[int, GpuPoint], ...]  # (GPU index, its values)


def _mean(points: Sequence[GpuPoint]) -> GpuPoint:
    n = len(points)
    return GpuPoint(time_ms=points[-1].time_ms,
                    utilization_percent=sum(p.utilization_percent for p in points) / n,
                    memory_used_mb=sum(p.memory_used_mb for p in points) / n,
                    temperature_c=sum(p.temperature_c for p in points) / n,
                    power_w=sum(p.power_w for p in points) / n,
                    sm_clock_mhz=sum(p.sm_clock_mhz for p in points) / n)


def downsample(points: Sequence[GpuPoint], start_ms: int, end_ms: int, max_points: int) -> list[GpuPoint]:
    """`points` (oldest first, within [start_ms, end_ms]) as at most `max_points`: the window cut into that many
    equal slices, each slice's polls averaged into one point; empty slices give none. 0: every point. Pure."""
    if max_points <= 0 or len(points) <= max_points:
        return list(points)
    width = max(1.0, (end_ms - start_ms) / max_points)
    out: list[GpuPoint] = []
    bucket: list[GpuPoint] = []
    current = -1
    for p in points:
        slot = min(max_points - 1, int((p.time_ms - start_ms) / width))
        if slot != current and bucket:
            out.append(_mean(bucket))
            bucket = []
        current = slot
        bucket.append(p)
    if bucket:
        out.append(_mean(bucket))
    return out


class GpuHistory:
    """Not thread-safe: only the event loop records and reads (the monitor hands its polls to the loop)."""

    def __init__(self, clock: Clock, *, interval_s: float, retention_s: float = DEFAULT_RETENTION_S) -> None:
        if interval_s <= 0 or retention_s <= 0:
            raise ValueError("interval_s and retention_s must be positive")
        self._clock = clock
        self.interval_s = interval_s
        self._frames: deque[_Frame] = deque(maxlen=min(MAX_FRAMES, max(1, math.ceil(retention_s / interval_s))))
        self._events: deque[GpuEvent] = deque(maxlen=MAX_EVENTS)
        self._seen: dict[int, tuple[Health, str]] = {}

    def _now_ms(self) -> int:
        return int(self._clock.now() * 1000)

    def record(self, metrics: Sequence[AcceleratorMetrics], gpus: Sequence[Accelerator]) -> None:
        now = self._now_ms()
        if metrics:
            self._frames.append(_Frame(now, tuple(
                (m.index, GpuPoint(now, float(m.utilization_percent), float(m.memory_used_mb),
                                   float(m.temperature_c), float(m.power_w), float(m.sm_clock_mhz)))
                for m in metrics)))
        for g in gpus:
            state = (g.health, g.health_reason)
            before = self._seen.get(g.index)
            self._seen[g.index] = state
            # The first sight of a healthy GPU is no event; of an unhealthy one (found before this agent started
            # polling, or kept across a restart) it is.
            if state != before and (before is not None or g.health is not Health.HEALTHY):
                self._events.append(GpuEvent(now, g.index, "health", g.health, g.health_reason))

    def xid(self, index: int, code: int, verdict: Verdict) -> None:
        self._events.append(GpuEvent(self._now_ms(), index, "xid", verdict.health, verdict.reason, xid=code))

    def window(self, window_s: int, max_points: int) -> HistoryWindow:
        """InvalidArgument for a window or a point count out of range."""
        if not 0 <= window_s <= MAX_WINDOW_S:
            raise InvalidArgument(f"window_s must be between 0 and {MAX_WINDOW_S} seconds (got {window_s})")
        if not 0 <= max_points <= MAX_POINTS:
            raise InvalidArgument(f"max_points must be between 0 and {MAX_POINTS} (got {max_points})")
        now = self._now_ms()
        if window_s == 0:
            frames = [self._frames[-1]] if self._frames else []
        else:
            start = now - window_s * 1000
            frames = [f for f in self._frames if f.time_ms >= start]
        series: dict[int, list[GpuPoint]] = {}
        for frame in frames:
            for index, point in frame.points:
                series.setdefault(index, []).append(point)
        start_ms = now - window_s * 1000
        gpus = {i: downsample(points, start_ms, now, max_points) for i, points in sorted(series.items())}
        retained = self._frames[0].time_ms if self._frames else 0
        return HistoryWindow(gpus=gpus, events=list(self._events), interval_s=self.interval_s,
                             retained_since_ms=retained, now_ms=now)
