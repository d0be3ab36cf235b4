"""Which nodes are alive, from the agents' heartbeats (kept in the leader's memory, never in etcd, so an
etcd leader change does not delay them).

A node is lost when no heartbeat reached this leader for `timeout_s`, and not before:

- A new leader has heard from nobody yet: every registered node counts as alive for `grace_s` after the
  leader starts (long enough for the agents to find it), so a failover never declares live nodes dead.
- Time this process itself did not run does not count as a node's silence. A ticker notes when the
  event loop last ran; a gap (a long GC pause, a CPU-starved host, a blocking call) is added to a running
  total of paused time, and a node's silence is measured without the pauses since its last heartbeat.
  Heartbeats that queued up in the socket during a pause are read right after it: without this, the
  first reconcile after a pause would declare every node lost.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from trainyard_core.clock import Clock

# The ticker's period; a gap longer than twice this is a pause of this process, not of the nodes.
TICK_S = 0.1


class NodeLiveness:
    def __init__(self, clock: Clock, timeout_s: float, *, grace_s: float | None = None) -> None:
        self._clock = clock
        self._timeout = timeout_s
        self._grace = timeout_s if grace_s is None else max(grace_s, timeout_s)
        # node → (monotonic time of its last heartbeat, total paused time at that moment)
        self._last: dict[str, tuple[float, float]] = {}
        self._since = clock.monotonic()
        self._paused = 0.0
        self._paused_at_since = 0.0
        self._last_tick = clock.monotonic()
        # What each agent last said it runs: {(job_id, attempt)}.
        self._running: dict[str, frozenset[tuple[str, int]]] = {}
        self._running_at: dict[str, float] = {}

    @property
    def timeout_s(self) -> float:
        return self._timeout

    def reset(self) -> None:
        """Start of a term as leader."""
        self._last.clear()
        self._running.clear()
        self._running_at.clear()
        self._since = self._clock.monotonic()
        self._paused_at_since = self._paused
        self._last_tick = self._since

    # -- pauses of this process -----------------------------------------------------------------------
    def tick(self) -> None:
        """Called every TICK_S by `run_ticker`; folds a gap since the last tick into the paused total."""
        now = self._clock.monotonic()
        self._paused += self._pause_now(now)
        self._last_tick = now

    def _pause_now(self, now: float) -> float:
        gap = now - self._last_tick
        return gap - TICK_S if gap > 2 * TICK_S else 0.0

    async def run_ticker(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.tick()
            try:
                await asyncio.wait_for(stop.wait(), TICK_S)
            except TimeoutError:
                pass

    def _silence(self, entry: tuple[float, float], now: float) -> float:
        seen_at, paused_then = entry
        paused = self._paused + self._pause_now(now) - paused_then
        return max(0.0, now - seen_at - paused)

    # -- reports --------------------------------------------------------------------------------------
    def report_running(self, node_id: str, running: frozenset[tuple[str, int]]) -> None:
        self._running[node_id] = running
        self._running_at[node_id] = self._clock.monotonic()

    def running(self) -> dict[str, frozenset[tuple[str, int]]]:
        return dict(self._running)

    def running_reported_at(self) -> dict[str, float]:
        """When each node's running report arrived (monotonic seconds)."""
        return dict(self._running_at)

    def seen(self, node_id: str) -> None:
        now = self._clock.monotonic()
        self._last[node_id] = (now, self._paused + self._pause_now(now))

    def forget(self, node_id: str) -> None:
        self._last.pop(node_id, None)
        self._running.pop(node_id, None)
        self._running_at.pop(node_id, None)

    def last_seen_age(self, node_id: str) -> float | None:
        """Seconds of silence (pauses of this process excluded); None when never heard from."""
        entry = self._last.get(node_id)
        return None if entry is None else self._silence(entry, self._clock.monotonic())

    def silence(self, node_ids: Iterable[str]) -> dict[str, float]:
        """Seconds of silence of each node (pauses of this process excluded); for a node never heard by this
        leader, the time since it leads."""
        now = self._clock.monotonic()
        out = {}
        for n in node_ids:
            e = self._last.get(n)
            out[n] = self._silence(e if e is not None else (self._since, self._paused_at_since), now)
        return out

    def alive(self, node_ids: Iterable[str]) -> frozenset[str]:
        now = self._clock.monotonic()
        in_grace = now - self._since < self._grace
        return frozenset(n for n in node_ids
                         if ((e := self._last.get(n)) is not None and self._silence(e, now) <= self._timeout)
                         or (e is None and in_grace))

    def next_expiry(self, node_ids: Iterable[str]) -> float | None:
        """Seconds until the first of `node_ids` now alive would be lost if it stays silent (None: none
        would); the reconcile loop wakes then, so a loss is acted on at the deadline, not a cycle later."""
        now = self._clock.monotonic()
        waits = []
        for n in node_ids:
            e = self._last.get(n)
            left = self._grace - (now - self._since) if e is None else self._timeout - self._silence(e, now)
            if left >= 0:
                waits.append(left)
        return min(waits) if waits else None
