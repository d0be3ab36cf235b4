"""A new leader's grace (liveness.py): how long it lasts, and which silent nodes it loses before it ends.

A new leader has heard from nobody, and during a failover every agent looks for it at once, so it keeps every
registered node alive for a while (`left_s`). That protects live nodes from the storm, but it also kept a node
whose host died during the failover alive until the grace ended, up to MAX_GRACE_S later.

A node on the connectionless path (no stream whose end would tell of a crash) from which a pulse of the session
this leader opened for it arrived has found it: its silence since says what it says after the grace, with one
exception. (Opening the session is not enough: on a busy leader the answer that carries it may reach an agent
whose call had already timed out, and that agent registers again, silent meanwhile.)
Silence that many such nodes share at once during the grace is taken as the storm's doing (one process
driving many agents starved, a congested switch, a saturated collector), not as that many hosts dying in
the same second. The same reasoning is behind Kubernetes' node controller, which stops evicting in a zone
where most nodes went unhealthy together. So during the grace such a node is lost when:

- it has been silent for its timeout plus CONFIRM_S (by then every node that went silent in the same
  moment has passed its timeout too, since they all pulse once per PULSE_INTERVAL_S), and
- at that moment at most `shared_limit` of the nodes that found this leader are silent past their timeout:
  SHARED_SILENCE_MIN, or SHARED_SILENCE_SHARE of those nodes when that is more.

Nodes held back by a shared silence are lost when the grace ends if they are still silent. When most of them
come back, those still silent no longer share their silence with many, so they are lost then. A node the grace
has lost stays lost until it is heard from again, whatever silence begins after it.

The grace lasts while such a silence goes on (until none was seen for the timeout, MAX_GRACE_S at most), as it
lasts while agents keep arriving. Measured at 5,000 simulated agents on 2 cores (bench/fleet) before it did:
every agent had been heard once about 29 s into a failover, so the grace ended 2.5 s later, while some 1,700
nodes that had found the leader were silent together in a storm still going on (their agents registering
again); 1,354 live nodes read not ready.

The grace lasts while agents keep arriving; once it has ended, a late first arrival does not open it again
(nodes already lost would otherwise read alive for another timeout).

Nor does it end while it would lose many of the registered nodes at once (more than MASS_LOSS_MIN, or
MASS_LOSS_SHARE of them), MAX_GRACE_S at most: that many unheard at once says the new leader cannot hear the
fleet (its store does not answer, so it serves no registration; it is starved), not that a tenth of the fleet
died in a failover. Kubernetes' node controller stops evicting in the same case ("full disruption"). Measured at
5,000 simulated agents: with etcd starved, a new leader served 34 registrations in 12 s, its grace ended and lost
4,966 live nodes at once. The price: a fleet where more than a tenth of the registered nodes are dead keeps every
new leader's grace for MAX_GRACE_S (those nodes read alive that long).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Set

from trainyard_core.rpc.pulse import PULSE_INTERVAL_S

# The longest a new leader's grace lasts while agents keep registering.
MAX_GRACE_S = 60.0
# How much longer than its timeout a node that found the new leader must be silent to be lost in the grace.
CONFIRM_S = 1.5 * PULSE_INTERVAL_S
# At most this many nodes (or this share of the nodes that found the leader, if that is more) may be silent
# past their timeout together for those nodes to be lost during the grace.
SHARED_SILENCE_MIN = 3
SHARED_SILENCE_SHARE = 0.01
# The grace does not end while it would lose more than this many of the registered nodes, or this share of
# them if that is more (MAX_GRACE_S at most).
MASS_LOSS_MIN = 3
MASS_LOSS_SHARE = 0.1

log = logging.getLogger(__name__)


class Grace:
    """One term's grace. Times are monotonic (`since`, arrivals: the grace runs on the wall clock) except where
    named effective (the liveness clock, which stops while this process is paused)."""

    def __init__(self, grace_s: float, timeout_s: float, now: float) -> None:
        self._grace = max(grace_s, timeout_s)
        self._timeout = timeout_s
        # The silence after which the grace loses a node that found this leader.
        self._lost_after = timeout_s + CONFIRM_S
        self.since = now
        self._last_arrival = now
        # When a silence many share (the storm's) was last seen: the grace lasts while it goes on.
        self._storm = -math.inf
        # Nodes without a stream whose pulse session with this leader carried a pulse in this term.
        self.found: set[str] = set()
        # The largest shared silence held back this term (logged when it grows past the last one logged).
        self._held = 0
        # Nodes this grace has lost that have stayed silent since.
        self._lost: set[str] = set()
        self._over_told = False

    def begin(self, now: float) -> None:
        """A new term."""
        self.since = now
        self._last_arrival = now
        self._storm = -math.inf
        self._over_told = False
        self.found.clear()
        self._held = 0
        self._lost.clear()

    def arrived(self, now: float) -> None:
        """A node was heard from for the first time this term, or an agent called to register (liveness.py,
        `knocking`): the grace lasts while agents keep arriving (not once it has ended)."""
        if self.left_s(now) > 0:
            self._last_arrival = now

    def left_s(self, now: float) -> float:
        """Seconds until the grace ends (0 or less: it has): `grace_s` after the term began, later while agents
        keep arriving (the last first contact plus the timeout) or a silence many share goes on (the last time
        one was seen plus the timeout), never past MAX_GRACE_S."""
        busy = max(self._last_arrival, self._storm)
        ends = min(max(self._grace, MAX_GRACE_S), max(self._grace, busy - self.since + self._timeout))
        return ends - (now - self.since)

    @property
    def ended(self) -> bool:
        """The grace has been declared over (`over`): it does not open again in this term."""
        return self._over_told

    def holds(self, losing: int, registered: int, now: float) -> bool:
        """The grace would end now, losing `losing` of the `registered` nodes: whether it goes on instead (so many
        at once are not taken for deaths; see the module docstring). Never once it has been declared over."""
        if self._over_told or now - self.since >= MAX_GRACE_S:
            return False
        if losing <= max(MASS_LOSS_MIN, math.ceil(MASS_LOSS_SHARE * registered)):
            return False
        if self._storm < self.since:
            log.warning("the new leader's grace goes on: it has not heard from many registered nodes", extra={
                "nodes_not_heard": losing, "nodes_registered": registered, "grace_s": round(now - self.since, 1)})
        self._storm = now
        return True

    def over(self, now: float, not_alive: int) -> None:
        """The grace has ended (`left_s` <= 0) and `not_alive` of the registered nodes are not alive: said once
        per term, so an operator reading a failover sees when the new leader began to lose nodes again."""
        if not self._over_told:
            self._over_told = True
            log.info("the new leader's grace is over", extra={
                "grace_s": round(now - self.since, 1), "nodes_not_alive": not_alive, "found_leader": len(self.found)})

    def shared_limit(self) -> int:
        return max(SHARED_SILENCE_MIN, math.ceil(SHARED_SILENCE_SHARE * len(self.found)))

    def _shared(self, silent: set[str]) -> bool:
        """Whether so many are silent together that the grace takes it for the storm's."""
        return len(silent) > self.shared_limit()

    def silent(self, expired: Set[str], ended: Set[str]) -> set[str]:
        """The nodes that found this leader and are silent past their timeout (`expired`), other than those
        whose stream ended (`ended`: lost on that evidence already)."""
        found = self.found
        return {n for n in expired if n in found and n not in ended}

    def lost(self, silent: set[str], last: Mapping[str, float], now_eff: float, now: float) -> set[str]:
        """Which of `silent` (see `silent`) the grace loses now: those silent CONFIRM_S past their timeout,
        unless more than `shared_limit` are silent together (the storm's: the grace then lasts while it goes
        on, `left_s`). `last`: each node's last proof of life (effective time); `now`: monotonic."""
        self._lost &= silent  # those heard from again are no longer lost
        if not silent:
            return set()
        if self._shared(silent):
            if self.left_s(now) > 0:
                self._storm = now
            if len(silent) > 2 * self._held:
                self._held = len(silent)
                log.warning("nodes silent together during the new leader's grace: kept until it ends",
                            extra={"silent_nodes": len(silent), "shared_limit": self.shared_limit(),
                                   "found_leader": len(self.found), "example_nodes": sorted(silent)[:5]})
            return set(self._lost)
        self._lost.update(n for n in silent if now_eff - last[n] >= self._lost_after)
        return set(self._lost)

    def next_loss_s(self, silent: set[str], last: Mapping[str, float], now_eff: float) -> float | None:
        """Seconds until the next of `silent` would be lost by `lost` (None: none would, as things stand)."""
        if not silent or self._shared(silent):
            return None
        waits = [wait for n in silent if (wait := last[n] + self._lost_after - now_eff) > 0]
        return min(waits) if waits else None
