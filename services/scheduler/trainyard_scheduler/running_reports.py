"""What each node's agent last said it runs, and when that report came: kept in the leader's memory beside the
nodes' liveness (liveness.py owns one and clears it with each term and each forgotten node), and read by every
cycle's snapshot: workers a node runs that no allocation names are strays to stop, and a report's time says
whether it is recent enough to act on (snapshot.py)."""

from __future__ import annotations

from collections.abc import Callable


class RunningReports:
    def __init__(self, monotonic: Callable[[], float]) -> None:
        self._monotonic = monotonic
        # node → {(job_id, attempt)} it last said it runs; only nodes that run something, so what each cycle
        # copies and walks (orphans) is the busy nodes, not the fleet.
        self._running: dict[str, frozenset[tuple[str, int]]] = {}
        self._at: dict[str, float] = {}  # node → when its last report came (monotonic seconds)

    def report(self, node_id: str, running: frozenset[tuple[str, int]]) -> None:
        if running:
            self._running[node_id] = running
        else:
            self._running.pop(node_id, None)
        self._at[node_id] = self._monotonic()

    def running(self) -> dict[str, frozenset[tuple[str, int]]]:
        """What each node that runs something last said it runs (a node absent runs nothing)."""
        return dict(self._running)

    def reported_at(self) -> dict[str, float]:
        """When each node's last report came (monotonic seconds)."""
        return dict(self._at)

    def forget(self, node_id: str) -> None:
        self._running.pop(node_id, None)
        self._at.pop(node_id, None)

    def clear(self) -> None:
        self._running.clear()
        self._at.clear()
