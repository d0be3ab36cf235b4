"""Which nodes are alive (kept in the leader's memory, never in etcd, so an etcd leader change does not
delay them).

A node's proof of life is its heartbeat stream to this leader (docs/architecture.md, "Node liveness"):

- While the stream is open the node is alive. HTTP/2 keepalive (`trainyard_core.rpc.liveness`) closes the
  connection of a peer that stops answering pings within KEEPALIVE_INTERVAL_S + KEEPALIVE_TIMEOUT_S, so an
  open stream is a live, reachable agent, and keeping it so costs no Python work per node.
- When the stream ends, the node's last proof of life is the end — less KEEPALIVE_TIMEOUT_S when it broke (a
  keepalive timeout, a reset, a crash), since the peer may have been silent that long before the break was
  noticed. A clean end (the agent closed its side while stopping) counts from the end itself.
- A node is lost when it has had no proof of life for `timeout_s`, and not before.
- Messages on the stream (beats: changes, and a refresh every heartbeat interval) are proof of life too. An
  open stream that carried no message for `stale_s` (three refresh intervals) means the agent's loop no
  longer runs though its process answers pings: the node is lost then as well.
- A new leader has heard from nobody yet: every registered node counts as alive for `grace_s` after the
  leader starts (long enough for the agents to find it), so a failover never declares live nodes dead.
- Time this process itself did not run does not count as a node's silence. A ticker notes when the
  event loop last ran; a gap (a long GC pause, a CPU-starved host, a blocking call) is added to a running
  total of paused time, and a node's silence is measured without the pauses since its last proof of life.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from trainyard_core.clock import Clock
from trainyard_core.rpc.liveness import KEEPALIVE_TIMEOUT_S

# The ticker's period; a gap longer than twice this is a pause of this process, not of the nodes.
TICK_S = 0.1


class NodeLiveness:
    def __init__(self, clock: Clock, timeout_s: float, *, grace_s: float | None = None,
                 stale_s: float | None = None, broken_s: float = KEEPALIVE_TIMEOUT_S) -> None:
        self._clock = clock
        self._timeout = timeout_s
        self._grace = timeout_s if grace_s is None else max(grace_s, timeout_s)
        self._stale = stale_s
        self._broken = broken_s
        # node → (monotonic time of its last proof of life, total paused time at that moment). For a node
        # with an open stream: its last message.
        self._last: dict[str, tuple[float, float]] = {}
        # node → its heartbeat streams open now (an agent that reconnects may briefly hold two).
        self._open: dict[str, int] = {}
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
        self._open.clear()
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

    def seen(self, node_id: str, *, backdate_s: float = 0.0) -> None:
        """A proof of life now (`backdate_s` earlier)."""
        now = self._clock.monotonic()
        self._last[node_id] = (now - backdate_s, self._paused + self._pause_now(now))

    def opened(self, node_id: str) -> None:
        """A heartbeat stream of the node is open from now on."""
        self._open[node_id] = self._open.get(node_id, 0) + 1
        self.seen(node_id)

    def closed(self, node_id: str, *, clean: bool) -> None:
        """One of the node's streams ended; `clean`: the agent closed it (not a break). A stream of an earlier
        term (opened before `reset`) ending now says nothing about this term."""
        if node_id not in self._open:
            return
        left = self._open[node_id] - 1
        if left > 0:
            self._open[node_id] = left
            return
        self._open.pop(node_id, None)
        self.seen(node_id, backdate_s=0.0 if clean else self._broken)

    def connected(self, node_id: str) -> bool:
        return self._open.get(node_id, 0) > 0

    def forget(self, node_id: str) -> None:
        self._last.pop(node_id, None)
        self._open.pop(node_id, None)
        self._running.pop(node_id, None)
        self._running_at.pop(node_id, None)

    def last_seen_age(self, node_id: str) -> float | None:
        """Seconds without proof of life (pauses of this process excluded; 0 while its stream is open and
        not stale); None when never heard from."""
        entry = self._last.get(node_id)
        return None if entry is None else self._age(node_id, entry, self._clock.monotonic())

    def _age(self, node_id: str, entry: tuple[float, float], now: float) -> float:
        quiet = self._silence(entry, now)
        if node_id in self._open and (self._stale is None or quiet <= self._stale):
            return 0.0
        return quiet

    def _limit(self, node_id: str) -> float:
        """How long the node may go without proof of life: a stale open stream counts from its last message."""
        return self._stale if node_id in self._open and self._stale is not None else self._timeout

    def silence(self, node_ids: Iterable[str]) -> dict[str, float]:
        """Seconds of silence of each node (pauses of this process excluded); for a node never heard by this
        leader, the time since it leads."""
        now = self._clock.monotonic()
        out = {}
        for n in node_ids:
            e = self._last.get(n)
            out[n] = self._age(n, e, now) if e is not None else self._silence((self._since, self._paused_at_since), now)
        return out

    def alive(self, node_ids: Iterable[str]) -> frozenset[str]:
        now = self._clock.monotonic()
        in_grace = now - self._since < self._grace
        return frozenset(n for n in node_ids
                         if ((e := self._last.get(n)) is not None and self._alive(n, e, now))
                         or (e is None and in_grace))

    def _alive(self, node_id: str, entry: tuple[float, float], now: float) -> bool:
        quiet = self._silence(entry, now)
        if node_id in self._open:
            return self._stale is None or quiet <= self._stale
        return quiet <= self._timeout

    def next_expiry(self, node_ids: Iterable[str]) -> float | None:
        """Seconds until the first of `node_ids` now alive would be lost if it stays silent (None: none
        would); the reconcile loop wakes then, so a loss is acted on at the deadline, not a cycle later."""
        now = self._clock.monotonic()
        waits = []
        for n in node_ids:
            e = self._last.get(n)
            left = self._grace - (now - self._since) if e is None else self._limit(n) - self._silence(e, now)
            if left >= 0:
                waits.append(left)
        return min(waits) if waits else None
