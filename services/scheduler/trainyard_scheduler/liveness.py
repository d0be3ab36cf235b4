"""Which nodes are alive (kept in the leader's memory, never in etcd, so an etcd leader change does not
delay them).

A node's proof of life is what reaches this leader from its agent (docs/architecture.md, "Node liveness"):

- Pulses: an agent that holds a pulse session (pulses.py; opened by its first `Beat` call, or by the
  heartbeat stream of an agent of an earlier version) sends an authenticated datagram every
  PULSE_INTERVAL_S; each valid one is a proof of life. An agent on the `Beat` path holds no stream and no
  connection: its beats are proofs of life, and its leaving beat is what a clean end of a stream is
  (`pulsing`, `left`). Such a node is alive while its last proof is at
  most `timeout_s` old, stream open or not: pulses, not the connection, say the agent runs and reaches us.
  When its stream breaks, its last pulse stands (nothing is added); a clean end (the agent closed its side
  while stopping) counts as a proof at the end itself.
- An open stream without pulses (an agent that did not ask for them) is alive while it is open: HTTP/2
  keepalive (`trainyard_core.rpc.liveness`) closes the connection of a peer that stops answering pings. When
  such a stream ends, its last proof is the end — less KEEPALIVE_TIMEOUT_S when it broke.
- Messages on the stream (beats: changes, and a refresh every heartbeat interval) are proofs of life too. An
  open stream without pulses that carried no message for `stale_s` (three refresh intervals) means the
  agent's loop no longer runs though its process answers pings: the node is lost then as well.
- A node is lost when it has had no proof of life for its limit, and not before.
- A new leader has heard from nobody yet: every registered node counts as alive for `grace_s` after the leader
  starts (long enough for the agents to find it), so a failover never declares live nodes dead. A large fleet
  takes longer than that to register again (every agent at once: thousands of TLS handshakes and registrations
  on one process), so the grace also lasts while agents keep arriving: it ends once `grace_s` has passed and
  for `timeout_s` no node was heard from for the first time this term and no agent called RegisterNode (served
  or not: `knocking`), and in any case MAX_GRACE_S after the term began. During the grace a node is lost only
  on evidence that it went: its heartbeat stream ended (a crashed agent's connection closes) and its timeout
  passed since; or, on the connectionless path, a pulse of the session this leader opened for it arrived (it
  found it) and then it stayed silent past its timeout while few other such nodes were silent with it
  (grace.py). A node that registered but whose first pulses wait behind thousands of other agents'
  registrations on a busy new leader is not lost for that, nor are the many nodes of one silence they share
  during the storm; a node that died silently during the failover before it found this leader is lost when the
  grace ends.
- Time this process itself did not run does not count as a node's silence. A ticker notes when the
  event loop last ran; a gap (a long GC pause, a CPU-starved host, a blocking call) is added to a running
  total of paused time, and a node's silence is measured without the pauses since its last proof of life.
"""

from __future__ import annotations

import asyncio
import heapq
import math
from collections.abc import Iterable
from types import MappingProxyType

from trainyard_core.clock import Clock
from trainyard_core.rpc.liveness import KEEPALIVE_TIMEOUT_S
from trainyard_core.waits import completes_within

from .grace import MAX_GRACE_S, Grace
from .running_reports import RunningReports

__all__ = ["MAX_GRACE_S", "TICK_S", "NodeLiveness"]

# The ticker's period; a gap longer than twice this is a pause of this process, not of the nodes.
TICK_S = 0.1


class NodeLiveness:
    """Kept incrementally: each proof of life moves the node's deadline, a heap orders the deadlines, and the
    nodes whose deadline passed are a set. What the reconcile loop asks every cycle (`alive`, `next_expiry`)
    is therefore set arithmetic plus the deadlines that passed since the last question, not a walk over the
    fleet.

    Times are kept on a clock that stops while this process is paused ("effective" time: monotonic time less
    the paused total), so a node's silence is the difference of two such readings."""

    def __init__(self, clock: Clock, timeout_s: float, *, grace_s: float | None = None,
                 stale_s: float | None = None, broken_s: float = KEEPALIVE_TIMEOUT_S) -> None:
        self._clock = clock
        self._timeout = timeout_s
        self._stale = stale_s
        self._broken = broken_s
        # node → effective time of its last proof of life (for a node with an open stream: its last message).
        self._last: dict[str, float] = {}
        # node → its heartbeat streams open now (an agent that reconnects may briefly hold two), and how many
        # of those hold a pulse session.
        self._open: dict[str, int] = {}
        self._pulsed: dict[str, int] = {}
        # node → the effective time it is lost at if nothing more is heard (absent: it cannot expire), the
        # heap of those deadlines (entries are dropped lazily once they no longer match), and the nodes whose
        # deadline has passed.
        self._deadline: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []
        self._expired: set[str] = set()
        # Nodes whose last heartbeat stream of this term ended (none open now): the evidence the grace needs.
        self._ended: set[str] = set()
        # Bumped whenever the expired set or the set of nodes ever heard from changes: `alive` over the same
        # node mapping at the same membership version is the answer it gave last (a cycle runs on every
        # change in etcd; the fleet's membership changes far less often).
        self._membership = 0
        self._alive_memo: tuple[object, int, bool, frozenset[str]] | None = None
        self._paused = 0.0
        self._last_tick = clock.monotonic()
        # This term's grace (when it began, on the monotonic clock, and how long it lasts), and when it began
        # on the effective clock (the silence of a node never heard from).
        self._term = Grace(timeout_s if grace_s is None else grace_s, timeout_s, clock.monotonic())
        self._since_eff = self._eff(self._term.since)
        # What each agent last said it runs, cleared with each term and each forgotten node.
        self.reports = RunningReports(clock.monotonic)

    @property
    def timeout_s(self) -> float:
        return self._timeout

    def reset(self) -> None:
        """Start of a term as leader."""
        self._last.clear()
        self._open.clear()
        self._pulsed.clear()
        self._deadline.clear()
        self._heap.clear()
        self._expired.clear()
        self._ended.clear()
        self._membership += 1
        self.reports.clear()
        now = self._clock.monotonic()
        self._last_tick = now
        self._term.begin(now)
        self._since_eff = self._eff(now)

    # -- pauses of this process -----------------------------------------------------------------------
    def tick(self) -> None:
        """Called every TICK_S by `run_ticker`; folds a gap since the last tick into the paused total."""
        now = self._clock.monotonic()
        self._paused += self._pause_now(now)
        self._last_tick = now

    def _pause_now(self, now: float) -> float:
        gap = now - self._last_tick
        return gap - TICK_S if gap > 2 * TICK_S else 0.0

    def _eff(self, now: float) -> float:
        return now - self._paused - self._pause_now(now)

    def _now(self) -> float:
        return self._eff(self._clock.monotonic())

    async def run_ticker(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.tick()
            await completes_within(stop.wait(), TICK_S)

    # -- deadlines ------------------------------------------------------------------------------------
    def _limit(self, node_id: str) -> float:
        """How long the node may go without proof of life: the timeout, unless it has an open stream without
        pulses, which only goes stale (or never, with no stale limit)."""
        if node_id in self._open and node_id not in self._pulsed:
            return math.inf if self._stale is None else self._stale
        return self._timeout

    def _rearm(self, node_id: str) -> None:
        if node_id in self._expired:
            self._expired.discard(node_id)
            self._membership += 1
        deadline = self._last[node_id] + self._limit(node_id)
        if deadline == math.inf:
            self._deadline.pop(node_id, None)
            return
        self._deadline[node_id] = deadline
        heapq.heappush(self._heap, (deadline, node_id))

    def _advance(self, now: float) -> None:
        """Move every node whose deadline is behind `now` to the expired set."""
        heap = self._heap
        while heap and heap[0][0] < now:
            deadline, node_id = heapq.heappop(heap)
            if self._deadline.get(node_id) == deadline:
                del self._deadline[node_id]
                self._expired.add(node_id)
                self._membership += 1

    def _heard(self, node_id: str, at: float) -> None:
        """A proof of life at effective time `at`."""
        if node_id not in self._last:
            self._membership += 1
            self._term.arrived(self._clock.monotonic())
        self._last[node_id] = at
        self._rearm(node_id)

    def knocking(self) -> None:
        """An agent called RegisterNode, whether or not this leader could serve it (refused while busy with the
        others, or failed while the store does not answer): agents are still arriving, and the grace lasts
        while they do. (Heard from only once its registration is served: a leader that cannot write to the
        store hears nobody, and must not take the fleet for dead when its grace would otherwise end.)"""
        self._term.arrived(self._clock.monotonic())

    def seen(self, node_id: str, *, backdate_s: float = 0.0) -> None:
        """A proof of life now (`backdate_s` earlier)."""
        self._heard(node_id, self._now() - backdate_s)

    def seen_many(self, node_ids: Iterable[str]) -> None:
        """A proof of life now from each of `node_ids` (a drain's pulses: one reading of the clock for all)."""
        now = self._now()
        for node_id in node_ids:
            self._heard(node_id, now)

    def opened(self, node_id: str, *, pulsed: bool = False) -> None:
        """A heartbeat stream of the node is open from now on; `pulsed`: it holds a pulse session."""
        self._open[node_id] = self._open.get(node_id, 0) + 1
        if pulsed:
            self._pulsed[node_id] = self._pulsed.get(node_id, 0) + 1
        self._term.found.discard(node_id)  # a stream's end is the grace's evidence from now on
        if node_id in self._ended:
            self._ended.discard(node_id)
            self._membership += 1
        self.seen(node_id)

    def closed(self, node_id: str, *, clean: bool, pulsed: bool = False) -> None:
        """One of the node's streams ended; `clean`: the agent closed it (not a break); `pulsed`: it held a
        pulse session. A stream of an earlier term (opened before `reset`) ending now says nothing about this
        term."""
        if node_id not in self._open:
            return
        if pulsed and node_id in self._pulsed:
            left_pulsed = self._pulsed[node_id] - 1
            if left_pulsed > 0:
                self._pulsed[node_id] = left_pulsed
            else:
                del self._pulsed[node_id]
        left = self._open[node_id] - 1
        if left > 0:
            self._open[node_id] = left
            self._rearm(node_id)
            return
        self._open.pop(node_id, None)
        self._ended.add(node_id)
        self._membership += 1
        if clean:
            self.seen(node_id)
        elif pulsed:
            self._rearm(node_id)  # its last pulse stands
        else:
            self.seen(node_id, backdate_s=self._broken)

    def pulsing(self, node_id: str) -> None:
        """A node that holds no stream (the connectionless path) had a pulse session opened: a proof of life now,
        and whatever ended before is over. It has not found this leader yet (`held`): the answer that carries
        the session may never reach an agent whose call timed out on a busy leader."""
        if node_id in self._ended:
            self._ended.discard(node_id)
            self._membership += 1
        self.seen(node_id)

    def held(self, node_ids: Iterable[str]) -> None:
        """The first pulse of each node's session (opened by `pulsing`) arrived: its agent holds the session,
        so it has found this leader (grace.py). A node on a heartbeat stream is not counted: its stream's end
        is the grace's evidence."""
        found, streams = self._term.found, self._open
        found.update(n for n in node_ids if n not in streams)

    def left(self, node_id: str) -> None:
        """A node that holds no stream said it is stopping (its leaving beat): as a stream's clean end, a proof
        of life now and evidence, for a new leader's grace, that it went."""
        if node_id in self._open:
            self.seen(node_id)
            return
        if node_id not in self._ended:
            self._ended.add(node_id)
            self._membership += 1
        self.seen(node_id)

    def connected(self, node_id: str) -> bool:
        return self._open.get(node_id, 0) > 0

    def forget(self, node_id: str) -> None:
        self._last.pop(node_id, None)
        self._open.pop(node_id, None)
        self._pulsed.pop(node_id, None)
        self._deadline.pop(node_id, None)
        self._expired.discard(node_id)
        self._ended.discard(node_id)
        self._term.found.discard(node_id)
        self._membership += 1
        self.reports.forget(node_id)

    # -- questions ------------------------------------------------------------------------------------
    def _quiet(self, node_id: str, now: float) -> float | None:
        seen = self._last.get(node_id)
        return None if seen is None else max(0.0, now - seen)

    def last_seen_age(self, node_id: str) -> float | None:
        """Seconds without proof of life (pauses of this process excluded; 0 while its stream is open and
        not stale); None when never heard from."""
        quiet = self._quiet(node_id, self._now())
        if quiet is None:
            return None
        return 0.0 if node_id in self._open and quiet <= self._limit(node_id) else quiet

    def silence(self, node_ids: Iterable[str]) -> dict[str, float]:
        """Seconds of silence of each node (pauses of this process excluded); for a node never heard by this
        leader, the time since it leads."""
        now = self._now()
        out = {}
        for n in node_ids:
            quiet = self._quiet(n, now)
            if quiet is None:
                out[n] = max(0.0, now - self._since_eff)
            else:
                out[n] = 0.0 if n in self._open and quiet <= self._limit(n) else quiet
        return out

    def alive(self, node_ids: Iterable[str]) -> frozenset[str]:
        """The nodes of `node_ids` alive now. Asked again with the same read-only mapping (the snapshot's
        nodes, unchanged) while no node expired, came back or was first heard from, it answers the same set
        object without walking the fleet (during the grace, only while no node that found this leader is
        silent: whether the grace loses such a node changes with time alone)."""
        mono = self._clock.monotonic()
        now = self._eff(mono)
        self._advance(now)
        ids: frozenset[str] | None = None
        graced = self._term.left_s(mono) <= 0
        if graced and not self._term.ended:
            # The grace would end now: not if it would lose too many at once (grace.py, `holds`).
            ids = frozenset(node_ids)
            losing = len(ids) - len(ids.difference(self._expired).intersection(self._last))
            graced = not self._term.holds(losing, len(ids), mono)
        silent = set() if graced else self._term.silent(self._expired, self._ended)
        memo = self._alive_memo
        if (memo is not None and memo[0] is node_ids and memo[1] == self._membership and memo[2] == graced
                and not silent and isinstance(node_ids, MappingProxyType)):
            return memo[3]
        ids = frozenset(node_ids) if ids is None else ids
        if graced:
            out = ids.difference(self._expired).intersection(self._last)
            self._term.over(mono, len(ids) - len(out))
        else:
            lost = self._term.lost(silent, self._last, now, mono)
            out = ids.difference(self._expired.intersection(self._ended), lost)
        self._alive_memo = (node_ids, self._membership, graced, out)
        return out

    def next_expiry(self, node_ids: Iterable[str]) -> float | None:
        """Seconds until the first node now alive would be lost if it stays silent (None: none would); the
        reconcile loop wakes then, so a loss is acted on at the deadline, not a cycle later. (A node this
        leader tracks but `node_ids` no longer names can make that wake early, never late.)"""
        now = self._now()
        self._advance(now)
        heap = self._heap
        while heap and self._deadline.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
        waits = [heap[0][0] - now] if heap else []
        in_grace = self._term.left_s(self._clock.monotonic())
        # The grace's end loses the nodes never heard from, and those silent past their timeout whose stream
        # did not end (kept alive only by the grace); before it ends, it loses the nodes that found this leader
        # and stayed silent (grace.py).
        if in_grace >= 0 and (not self._expired.issubset(self._ended)
                              or not frozenset(node_ids).issubset(self._last)):
            waits.append(in_grace)
            confirm = self._term.next_loss_s(self._term.silent(self._expired, self._ended), self._last, now)
            if confirm is not None:
                waits.append(confirm)
        return min(waits) if waits else None
