"""The fleet over time, for GET /v1/fleet/metrics and the web console, without a Prometheus server.

Two sources, each where the data is:
- Allocation (how many GPUs jobs hold, of how many, by model) is the scheduler's knowledge. `FleetHistory`
  asks the scheduler for its node list every `fleet_sample_interval_s` and records one `AllocationPoint` in a
  ring of the last 24 hours (at most MAX_SAMPLES points), from the first GET /v1/fleet/metrics on (whose own
  node list is the first point), so a gateway nobody asks costs the scheduler nothing. Each gateway replica
  keeps its own; a restarted gateway starts an empty one. A failed read is skipped and tried again after
  RETRY_S (or the interval, if shorter); it is logged once when reads start failing and once when they work
  again.
- GPU telemetry (utilization, memory, temperature, power) is the agents': each keeps a ring buffer of its
  own polls (trainyard_agent/gpu_history.py). `LatestGpus` asks every node's agent for its latest poll
  (GetGpuMetrics with window 0), at most FANOUT_CONCURRENCY at a time with a short deadline each, and
  shares the readings among the requests of CACHE_S, so many open consoles cost the agents one round (each
  answer joins them with its own request's node list: allocation and health are as fresh as that). A node
  whose agent does not answer is listed as unreachable; the others are answered all the same.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime

from trainyard_core.clock import Clock, SystemClock
from trainyard_core.errors import TrainyardError
from trainyard_core.waits import cancel_and_wait

from . import convert
from .clients import AgentClients
from .joblogs import failure
from .schemas.metrics import AllocationPoint, FleetGpu, ModelAllocation, UnreachableNode
from .schemas.nodes import Node

log = logging.getLogger(__name__)

RETENTION_S = 86_400.0
MAX_SAMPLES = 5_760
FANOUT_CONCURRENCY = 64
FANOUT_TIMEOUT_S = 3.0
CACHE_S = 2.0
# After a failed read the next comes sooner than the interval (a gateway started before its scheduler leads).
RETRY_S = 2.0
# Nodes whose agents answer the scheduler: a cordoned node is out of placement, not down, and keeps its jobs.
UP_STATES = ("ready", "cordoned")


def allocation_point(nodes: Sequence[Node], at: datetime) -> AllocationPoint:
    """The fleet's allocation in one point. Pure. Capacity counts the GPUs of ready nodes (cordoned ones
    included: they still hold their jobs)."""
    models: dict[str, ModelAllocation] = {}
    total = allocated = unhealthy = 0
    ready = [n for n in nodes if n.state in UP_STATES]
    for node in ready:
        for gpu in node.gpus:
            total += 1
            allocated += gpu.allocated
            unhealthy += gpu.health in ("degraded", "unhealthy")
            entry = models.setdefault(gpu.model or "unknown", ModelAllocation(total=0, allocated=0))
            entry.total += 1
            entry.allocated += gpu.allocated
    return AllocationPoint(time=at, nodes_ready=len(ready), nodes_total=len(nodes), gpus_total=total,
                           gpus_allocated=allocated, gpus_unhealthy=unhealthy, models=dict(sorted(models.items())))


class FleetHistory:
    """The ring of allocation points, oldest first, and the loop that adds one every `interval_s`. Only the event
    loop touches it. Recording starts with the first `observe` (the first GET /v1/fleet/metrics): a gateway that
    nobody asks for the fleet's history asks the scheduler nothing for it."""

    def __init__(self, interval_s: float, read_nodes: Callable[[], Awaitable[list[Node]]], *,
                 clock: Clock | None = None) -> None:
        self.interval_s = interval_s
        self._read = read_nodes
        self._clock = clock or SystemClock()
        self._points: deque[AllocationPoint] = deque(maxlen=max(1, min(MAX_SAMPLES, int(RETENTION_S / interval_s))))
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    def observe(self, nodes: Sequence[Node]) -> None:
        """A node list a request just read: recorded unless a point is less than half an interval old; starts the
        loop the first time."""
        now = self._clock.now()
        if not self._points or now - self._points[-1].time.timestamp() >= self.interval_s / 2:
            self._record(nodes, now)
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="fleet-history")

    def window(self, window_s: int, now: datetime) -> list[AllocationPoint]:
        start = now.timestamp() - window_s
        return [p for p in self._points if p.time.timestamp() >= start]

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    def _record(self, nodes: Sequence[Node], now: float) -> None:
        self._points.append(allocation_point(nodes, datetime.fromtimestamp(now, tz=UTC)))

    async def sample_once(self) -> bool:
        try:
            nodes = await self._read()
        except TrainyardError as exc:
            if not self._failing:
                log.warning("cannot read the fleet for the console's allocation history; retrying",
                            extra={"error": exc.message, "retry_s": min(RETRY_S, self.interval_s)})
            self._failing = True
            return False
        if self._failing:
            log.info("reading the fleet for the console's allocation history again")
        self._failing = False
        self._record(nodes, self._clock.now())
        return True

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time() + self.interval_s
        while True:
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            recorded = False
            try:
                recorded = await self.sample_once()
            except Exception:
                log.exception("recording the fleet's allocation failed")
            now = loop.time()
            next_at = max(next_at + self.interval_s, now) if recorded else now + min(RETRY_S, self.interval_s)


Reading = tuple[float, float, float, float]  # utilization %, memory used MB, temperature °C, power W


class LatestGpus:
    """Every GPU with its agent's latest poll. The agents' readings are shared among the requests of CACHE_S; each
    answer joins them with the node list its request read, so allocation and health are never older than that."""

    def __init__(self, agents: AgentClients, *, clock: Clock | None = None) -> None:
        self._agents = agents
        self._clock = clock or SystemClock()
        self._lock = asyncio.Lock()
        self._read_at = 0.0
        self._asked: frozenset[str] = frozenset()
        self._readings: dict[str, dict[int, Reading]] = {}
        self._failed: dict[str, TrainyardError] = {}

    async def read(self, nodes: Sequence[Node], *, show_addresses: bool) -> tuple[list[FleetGpu],
                                                                                  list[UnreachableNode]]:
        """`nodes`: the scheduler's own view (agent addresses not redacted). Messages about unreachable agents
        name their addresses only for callers that may see them."""
        wanted = frozenset(n.node_id for n in nodes if n.agent_address and n.state in UP_STATES)
        async with self._lock:
            if wanted != self._asked or self._clock.monotonic() - self._read_at > CACHE_S:
                self._readings, self._failed = await self._fan_out([n for n in nodes if n.node_id in wanted])
                self._asked, self._read_at = wanted, self._clock.monotonic()
            readings, failed = self._readings, self._failed
        gpus = []
        for node in nodes:
            mine = readings.get(node.node_id, {})
            for g in node.gpus:
                util, mem, temp, power = mine.get(g.index, (None, None, None, None))
                gpus.append(FleetGpu(node_id=node.node_id, index=g.index, model=g.model, memory_mb=g.memory_mb,
                                     health=g.health, allocated=g.allocated, utilization_percent=util,
                                     memory_used_mb=mem, temperature_c=temp, power_w=power))
        return gpus, [UnreachableNode(node_id=node_id, message=failure(exc, node_id, show_addresses))
                      for node_id, exc in sorted(failed.items())]

    async def _fan_out(self, nodes: Sequence[Node]) -> tuple[dict[str, dict[int, Reading]],
                                                           dict[str, TrainyardError]]:
        gate = asyncio.Semaphore(FANOUT_CONCURRENCY)
        readings: dict[str, dict[int, Reading]] = {}
        failed: dict[str, TrainyardError] = {}

        async def one(node: Node) -> None:
            assert node.agent_address
            try:
                async with gate:
                    reply = await self._agents.gpu_metrics(node.agent_address, node_id=node.node_id, window_s=0,
                                                           max_points=0, timeout_s=FANOUT_TIMEOUT_S)
            except TrainyardError as exc:
                failed[node.node_id] = exc
                return
            readings[node.node_id] = {
                series.index: (s.utilization_percent, s.memory_used_mb, s.temperature_c, s.power_w)
                for series in convert.node_metrics_from_pb(node.node_id, 0, reply).gpus
                for s in series.samples[-1:]}

        await asyncio.gather(*(one(n) for n in nodes))
        return readings, failed
