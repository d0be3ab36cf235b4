"""Which nodes are alive, from the agents' heartbeats (kept in the leader's memory).

A new leader has heard from nobody yet: every registered node counts as alive for one timeout after the
leader starts, long enough for connected agents to reach it, so a failover never declares live nodes dead.
"""

from __future__ import annotations

from collections.abc import Iterable

from trainyard_core.clock import Clock


class NodeLiveness:
    def __init__(self, clock: Clock, timeout_s: float) -> None:
        self._clock = clock
        self._timeout = timeout_s
        self._last: dict[str, float] = {}
        self._since = clock.monotonic()
        # What each agent last said it runs: {(job_id, attempt)}.
        self._running: dict[str, frozenset[tuple[str, int]]] = {}
        self._running_at: dict[str, float] = {}

    def reset(self) -> None:
        """Start of a term as leader."""
        self._last.clear()
        self._running.clear()
        self._running_at.clear()
        self._since = self._clock.monotonic()

    def report_running(self, node_id: str, running: frozenset[tuple[str, int]]) -> None:
        self._running[node_id] = running
        self._running_at[node_id] = self._clock.monotonic()

    def running(self) -> dict[str, frozenset[tuple[str, int]]]:
        return dict(self._running)

    def running_reported_at(self) -> dict[str, float]:
        """When each node's running report arrived (monotonic seconds)."""
        return dict(self._running_at)

    def seen(self, node_id: str) -> None:
        self._last[node_id] = self._clock.monotonic()

    def forget(self, node_id: str) -> None:
        self._last.pop(node_id, None)
        self._running.pop(node_id, None)
        self._running_at.pop(node_id, None)

    def last_seen_age(self, node_id: str) -> float | None:
        t = self._last.get(node_id)
        return None if t is None else self._clock.monotonic() - t

    def alive(self, node_ids: Iterable[str]) -> frozenset[str]:
        now = self._clock.monotonic()
        in_grace = now - self._since < self._timeout
        return frozenset(n for n in node_ids
                         if ((t := self._last.get(n)) is not None and now - t <= self._timeout)
                         or (t is None and in_grace))
