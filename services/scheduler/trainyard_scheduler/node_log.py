"""The leader's log of nodes going and coming back: one line when a registered node stops being alive
(WARNING, with how long it has been silent) and one when it is alive again (INFO), each with the node's id.

Driven by the snapshot each reconcile cycle builds, so it says what the scheduler acts on (a node a new leader
still counts as alive during its grace is not logged as lost). A first snapshot of a term is the baseline and
logs nothing (a reconciler, and so this, lives for one term). When many nodes change at once (a rack's switch,
a partition) the first MAX_LINES get a line each and the rest one line with their count."""

from __future__ import annotations

import logging

from trainyard_core.logs import log_context

from .domain.snapshot import ClusterSnapshot

log = logging.getLogger(__name__)

# Per direction and cycle: lines naming one node each before the rest are summed up in one.
MAX_LINES = 20


class NodeTransitions:
    def __init__(self) -> None:
        self._alive: frozenset[str] | None = None
        self._known: frozenset[str] = frozenset()

    def observe(self, snap: ClusterSnapshot) -> tuple[list[str], list[str]]:
        """Log the nodes lost and back since the last snapshot; returns them (sorted) as (lost, back)."""
        before, alive, known = self._alive, snap.alive, self._known
        self._alive = alive
        if before is None or before is not alive:
            self._known = frozenset(snap.nodes)
        if before is None or before is alive:
            return [], []
        lost = sorted((before - alive) & snap.nodes.keys())
        back = sorted((alive - before) & known)  # a node registered since is not "back" (the servicer logs it)
        for node_id in lost[:MAX_LINES]:
            silent = snap.silence.get(node_id)
            with log_context(node_id=node_id):
                log.warning("node lost: no proof of life from its agent", extra={
                    "silent_s": round(silent, 2) if silent is not None else None})
        for node_id in back[:MAX_LINES]:
            with log_context(node_id=node_id):
                log.info("node alive again")
        if len(lost) > MAX_LINES:
            log.warning("%d more nodes lost", len(lost) - MAX_LINES, extra={"first": lost[MAX_LINES:][:5]})
        if len(back) > MAX_LINES:
            log.info("%d more nodes alive again", len(back) - MAX_LINES)
        return lost, back
