"""Node liveness as the leader sees it: lost after the timeout and not before — not during a new leader's
grace, and not because this process itself was paused (time it did not run is not a node's silence)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from trainyard_core.clock import ManualClock
from trainyard_scheduler.grace import CONFIRM_S
from trainyard_scheduler.liveness import MAX_GRACE_S, TICK_S, NodeLiveness

NODES = ("n-a", "n-b")


def ticking(clock: ManualClock, live: NodeLiveness, seconds: float, *, beats: tuple[str, ...] = ()) -> None:
    """The process runs normally for `seconds`: the ticker ticks, the `beats` nodes heartbeat every tick."""
    steps = round(seconds / TICK_S)
    for _ in range(steps):
        clock.advance(TICK_S)
        live.tick()
        for n in beats:
            live.seen(n)


def test_a_silent_node_is_lost_after_the_timeout_and_not_before() -> None:
    clock = ManualClock()
    live = NodeLiveness(clock, timeout_s=2.5, grace_s=0)
    live.seen("n-a")
    live.seen("n-b")
    ticking(clock, live, 2.4, beats=("n-a",))
    assert live.alive(NODES) == {"n-a", "n-b"}
    expiry = live.next_expiry(NODES)
    assert expiry is not None and abs(expiry - 0.1) < 1e-6, "the reconcile loop wakes at n-b's deadline"
    ticking(clock, live, 0.2, beats=("n-a",))
    assert live.alive(NODES) == {"n-a"}
    expiry = live.next_expiry(NODES)
    assert expiry is not None and abs(expiry - 2.5) < 1e-6, "the next deadline is n-a's"
    live.seen("n-b")
    assert live.alive(NODES) == {"n-a", "n-b"}, "a node that talks again is alive again"


def test_a_pause_of_the_scheduler_is_not_the_nodes_silence() -> None:
    clock = ManualClock()
    live = NodeLiveness(clock, timeout_s=2.5, grace_s=0)
    live.seen("n-a")
    ticking(clock, live, 1.0, beats=("n-a",))
    # The event loop does not run for 10 s (a GC pause, a starved CPU). Nothing has ticked when the first
    # reconcile after it asks: the heartbeats that queued up in the meantime are not read yet.
    clock.advance(10.0)
    assert live.alive(NODES) == {"n-a"}
    live.tick()
    assert live.alive(NODES) == {"n-a"}
    # Real silence after the pause still counts.
    ticking(clock, live, 2.4)
    assert live.alive(NODES) == {"n-a"}
    ticking(clock, live, 0.3)
    assert live.alive(NODES) == frozenset()


def test_a_new_leader_gives_unheard_nodes_a_grace_period() -> None:
    clock = ManualClock()
    live = NodeLiveness(clock, timeout_s=2.5, grace_s=5.0)
    live.reset()
    ticking(clock, live, 4.9)
    assert live.alive(NODES) == {"n-a", "n-b"}
    live.seen("n-a")
    ticking(clock, live, 0.2, beats=("n-a",))
    assert live.alive(NODES) == {"n-a", "n-b"}, "agents still arrive (n-a 0.2 s ago): the grace goes on"
    ticking(clock, live, 2.4, beats=("n-a",))
    assert live.alive(NODES) == {"n-a"}, "a timeout without a new arrival after the grace: only nodes that spoke"
    # Agents that keep arriving hold the grace open, but never past MAX_GRACE_S.
    slow = NodeLiveness(clock, timeout_s=2.5, grace_s=5.0)
    slow.reset()
    for i in range(int(MAX_GRACE_S)):
        slow.seen(f"late-{i}")
        ticking(clock, slow, 1.0, beats=("late-0",))
        if i == MAX_GRACE_S // 2:
            assert slow.alive(["never"]) == {"never"}, "agents still arrive: a node not heard yet is not lost"
    assert slow.alive(["never", "late-0"]) == {"late-0"}, "the grace ended at MAX_GRACE_S"
    # The grace is never shorter than the timeout.
    short = NodeLiveness(clock, timeout_s=2.5, grace_s=1.0)
    short.reset()
    ticking(clock, short, 2.0)
    assert short.alive(NODES) == {"n-a", "n-b"}


async def test_the_ticker_runs_until_stopped() -> None:
    clock = ManualClock()
    live = NodeLiveness(clock, timeout_s=2.5)
    stop = asyncio.Event()
    task = asyncio.create_task(live.run_ticker(stop))
    await asyncio.sleep(TICK_S * 2.5)
    stop.set()
    await asyncio.wait_for(task, 1.0)


def test_an_open_stream_is_alive_without_messages_and_a_stale_one_is_not() -> None:
    clock = ManualClock()
    live = NodeLiveness(clock, timeout_s=2.0, grace_s=0, stale_s=30.0)
    live.opened("n-a")
    ticking(clock, live, 29.0)
    assert live.alive(NODES) == {"n-a"} and live.silence(["n-a"]) == {"n-a": 0.0}
    assert live.connected("n-a") and live.last_seen_age("n-a") == 0.0
    expiry = live.next_expiry(["n-a"])
    assert expiry is not None and abs(expiry - 1.0) < 1e-6, "the stale deadline is the next one to look at"
    ticking(clock, live, 1.2)
    assert live.alive(NODES) == frozenset(), "open but silent for 3 refresh intervals: the agent's loop is stuck"
    live.seen("n-a")
    assert live.alive(NODES) == {"n-a"}


def test_a_broken_stream_counts_from_a_keepalive_timeout_before_the_break() -> None:
    clock = ManualClock()
    live = NodeLiveness(clock, timeout_s=2.0, grace_s=0, broken_s=1.0)
    live.opened("n-a")
    live.opened("n-b")
    ticking(clock, live, 5.0)
    live.closed("n-a", clean=False)   # keepalive timeout or reset: silent for up to a second already
    live.closed("n-b", clean=True)    # the agent ended its stream while stopping
    assert not live.connected("n-a")
    assert abs(live.silence(["n-a"])["n-a"] - 1.0) < 1e-6 and live.silence(["n-b"]) == {"n-b": 0.0}
    ticking(clock, live, 0.9)
    assert live.alive(NODES) == {"n-a", "n-b"}
    ticking(clock, live, 0.2)
    assert live.alive(NODES) == {"n-b"}, "lost 1 s after the break: 2 s after its last proof of life"
    ticking(clock, live, 1.0)
    assert live.alive(NODES) == frozenset()


def test_a_second_stream_keeps_the_node_connected_until_both_end() -> None:
    clock = ManualClock()
    live = NodeLiveness(clock, timeout_s=2.0, grace_s=0)
    live.opened("n-a")
    live.opened("n-a")      # the agent reconnected before the old stream's end reached us
    live.closed("n-a", clean=False)
    ticking(clock, live, 10.0)
    assert live.connected("n-a") and live.alive(["n-a"]) == {"n-a"}
    live.closed("n-a", clean=False)
    assert not live.connected("n-a")
    ticking(clock, live, 1.1)
    assert live.alive(["n-a"]) == frozenset()


def test_a_pause_of_the_scheduler_after_a_break_is_not_the_nodes_silence() -> None:
    clock = ManualClock()
    live = NodeLiveness(clock, timeout_s=2.0, grace_s=0)
    live.opened("n-a")
    live.closed("n-a", clean=True)
    ticking(clock, live, 0.5)
    clock.advance(5.0)   # the process did not run
    live.tick()
    assert live.alive(["n-a"]) == {"n-a"}
    ticking(clock, live, 1.6)
    assert live.alive(["n-a"]) == frozenset()


def test_a_stream_of_the_last_term_ending_after_a_new_term_began_is_ignored() -> None:
    clock = ManualClock()
    live = NodeLiveness(clock, timeout_s=2.0, grace_s=5.0)
    live.opened("n-a")
    live.reset()                       # this replica leads again before the old stream's end arrived
    live.closed("n-a", clean=False)
    ticking(clock, live, 4.0)
    assert live.alive(["n-a"]) == {"n-a"}, "still within the new term's grace: never heard from in it"


# --- the incremental bookkeeping against the rules stated plainly ------------------------------------------

class _Plain:
    """The liveness rules computed from scratch at every question: what NodeLiveness's heap and expired set
    must agree with."""

    def __init__(self, timeout: float, grace: float, stale: float | None, broken: float) -> None:
        self.timeout, self.grace, self.stale, self.broken = timeout, max(grace, timeout), stale, broken
        self.eff = 0.0      # time the process ran
        self.mono = 0.0
        self.last: dict[str, float] = {}
        self.open: dict[str, int] = {}
        self.pulsed: dict[str, int] = {}
        self.arrival = 0.0  # the last first contact this term (the grace lasts while agents arrive)
        self.ended: set[str] = set()  # nodes whose last stream ended (the evidence the grace needs)
        # Nodes without a stream whose pulse session carried a pulse this term: lost in the grace once silent for their
        # timeout plus CONFIRM_S (three nodes never make a silence shared by more than SHARED_SILENCE_MIN).
        self.found: set[str] = set()

    def in_grace(self, mono: float) -> bool:
        return mono < min(max(self.grace, MAX_GRACE_S), max(self.grace, self.arrival + self.timeout))

    def arrived(self, mono: float) -> None:
        """A first contact this term holds the grace open while it lasts; once ended, it stays ended."""
        if self.in_grace(mono):
            self.arrival = mono

    def alive(self, nodes: tuple[str, ...]) -> tuple[frozenset[str], frozenset[str]]:
        """The nodes alive, and those too close to their deadline for two float sums to agree on."""
        out, close = set(), set()
        in_grace = self.in_grace(self.mono)
        for n in nodes:
            if n not in self.last or (in_grace and n not in self.ended):
                if not in_grace:
                    continue
                if n in self.found and n in self.last:
                    quiet, after = self.eff - self.last[n], self.timeout + CONFIRM_S
                    if quiet < after:
                        out.add(n)
                    if abs(quiet - after) < 1e-6:
                        close.add(n)
                else:
                    out.add(n)
                continue
            quiet = self.eff - self.last[n]
            unpulsed_open = n in self.open and n not in self.pulsed
            limit = (self.stale if self.stale is not None else float("inf")) if unpulsed_open else self.timeout
            if quiet <= limit:
                out.add(n)
            if abs(quiet - limit) < 1e-6:
                close.add(n)
        return frozenset(out), frozenset(close)


def test_the_incremental_bookkeeping_agrees_with_the_rules_at_every_step() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    ops = st.lists(st.tuples(st.sampled_from(["run", "pause", "seen", "open", "close", "break", "forget",
                                              "open_p", "close_p", "break_p", "pulsing", "held"]),
                             st.sampled_from(["n-a", "n-b", "n-c"]), st.integers(1, 40)), max_size=60)

    @settings(max_examples=300, deadline=None)
    @given(ops, st.sampled_from([None, 3.0]))
    def check(steps: list[tuple[str, str, int]], stale: float | None) -> None:
        nodes = ("n-a", "n-b", "n-c")
        clock = ManualClock()
        # broken_s given, not the default (the keepalive timeout): the model below is told the same.
        live = NodeLiveness(clock, timeout_s=2.0, grace_s=3.0, stale_s=stale, broken_s=1.0)
        live.reset()
        plain = _Plain(2.0, 3.0, stale, 1.0)
        start = clock.monotonic()
        for op, node, n in steps:
            if op == "run":  # the loop runs normally for n ticks
                for _ in range(n):
                    clock.advance(TICK_S)
                    live.tick()
                    plain.eff += TICK_S
            elif op == "pause":  # the process does not run for n ticks (then ticks once)
                clock.advance(TICK_S * n)
                live.tick()
                plain.eff += TICK_S * n if n <= 2 else TICK_S
            elif op == "seen":
                live.seen(node)
                if node not in plain.last:
                    plain.arrived(clock.monotonic() - start)
                plain.last[node] = plain.eff
            elif op in ("open", "open_p"):
                pulsed = op == "open_p"
                live.opened(node, pulsed=pulsed)
                plain.open[node] = plain.open.get(node, 0) + 1
                if pulsed:
                    plain.pulsed[node] = plain.pulsed.get(node, 0) + 1
                if node not in plain.last:
                    plain.arrived(clock.monotonic() - start)
                plain.ended.discard(node)
                plain.found.discard(node)
                plain.last[node] = plain.eff
            elif op == "pulsing":  # a node without a stream opens a pulse session (the connectionless path)
                if node in plain.open:
                    continue  # not a call the servicer makes for a node that holds a stream
                live.pulsing(node)
                if node not in plain.last:
                    plain.arrived(clock.monotonic() - start)
                plain.ended.discard(node)
                plain.last[node] = plain.eff
            elif op == "held":  # a pulse drain carried the first pulse of the node's session
                live.seen_many([node])
                live.held([node])
                if node not in plain.last:
                    plain.arrived(clock.monotonic() - start)
                if node not in plain.open:
                    plain.found.add(node)
                plain.last[node] = plain.eff
            elif op in ("close", "break", "close_p", "break_p") and (
                    plain.pulsed.get(node, 0) if op.endswith("_p")
                    else plain.open.get(node, 0) - plain.pulsed.get(node, 0)) > 0:
                pulsed, clean = op.endswith("_p"), op.startswith("close")
                live.closed(node, clean=clean, pulsed=pulsed)
                if pulsed:
                    plain.pulsed[node] -= 1
                    if not plain.pulsed[node]:
                        del plain.pulsed[node]
                plain.open[node] -= 1
                if not plain.open[node]:
                    del plain.open[node]
                    plain.ended.add(node)
                    if clean:
                        plain.last[node] = plain.eff
                    elif not pulsed:
                        plain.last[node] = plain.eff - plain.broken
            elif op == "forget":
                live.forget(node)
                plain.last.pop(node, None)
                plain.open.pop(node, None)
                plain.pulsed.pop(node, None)
                plain.ended.discard(node)
                plain.found.discard(node)
            plain.mono = clock.monotonic() - start
            expected, close = plain.alive(nodes)
            assert live.alive(nodes) - close == expected - close, (op, node, n)
            expiry = live.next_expiry(nodes)
            if expiry is not None:
                # Waking then finds a change (or a node the caller no longer names): never a wake too late.
                assert expiry >= 0

    check()


def test_alive_over_an_unchanged_read_only_fleet_is_remembered_until_membership_changes() -> None:
    from types import MappingProxyType

    clock = ManualClock()
    live = NodeLiveness(clock, timeout_s=2.5, grace_s=0)
    fleet = MappingProxyType({"n-a": object(), "n-b": object(), "n-c": object()})
    for n in fleet:
        live.seen(n)
    first = live.alive(fleet)
    ticking(clock, live, 1.0, beats=("n-a", "n-b", "n-c"))
    assert live.alive(fleet) is first == {"n-a", "n-b", "n-c"}, "nothing expired, came back or was new: the same set"
    ticking(clock, live, 2.6, beats=("n-a", "n-b"))
    assert live.alive(fleet) == {"n-a", "n-b"}, "n-c's deadline passed: the remembered answer is not reused"
    live.seen("n-c")
    assert live.alive(fleet) == {"n-a", "n-b", "n-c"}, "n-c talked again"
    other = MappingProxyType({"n-a": object()})
    assert live.alive(other) == {"n-a"}, "another fleet mapping is its own question"
    live.forget("n-b")
    assert live.alive(fleet) == {"n-a", "n-c"}
    plain = {"n-a": object(), "n-d": object()}
    assert live.alive(plain) == {"n-a"}
    plain["n-c"] = object()  # a mutable mapping may change under the same object: never remembered
    assert live.alive(plain) == {"n-a", "n-c"}


def test_in_the_grace_only_a_node_whose_stream_ended_is_lost() -> None:
    """A new leader under a registration storm: n-a registered and then nothing reached the leader in time (its
    first pulses wait behind other agents' registrations), n-b's agent crashed (its stream broke). Only n-b is
    lost before the grace ends; n-a, still silent, when it does."""
    clock = ManualClock()
    live = NodeLiveness(clock, timeout_s=2.5, grace_s=5.0)
    live.reset()
    live.seen("n-a")                      # RegisterNode
    live.opened("n-b", pulsed=True)
    live.closed("n-b", clean=False, pulsed=True)
    ticking(clock, live, 3.0)
    assert live.alive(NODES) == {"n-a"}, "n-b's stream ended and its timeout passed; n-a is in the grace"
    ticking(clock, live, 2.5)
    assert live.alive(NODES) == frozenset(), "the grace is over: n-a's silence counts now"
    live.opened("n-b", pulsed=True)
    assert live.alive(NODES) == {"n-b"}, "n-b came back"


def test_the_loop_wakes_when_the_grace_ends_for_a_node_only_the_grace_keeps() -> None:
    clock = ManualClock()
    live = NodeLiveness(clock, timeout_s=2.5, grace_s=5.0)
    live.reset()
    live.seen("n-a")
    live.seen("n-b")
    ticking(clock, live, 3.0, beats=("n-b",))   # n-a silent past its timeout, its stream never ended
    assert live.alive(NODES) == {"n-a", "n-b"}, "the grace keeps n-a"
    expiry = live.next_expiry(NODES)
    assert expiry is not None and abs(expiry - 2.0) < 1e-6, "the loop wakes when the grace ends (5 s), not later"


def test_in_the_grace_a_node_that_found_this_leader_and_went_silent_is_lost_soon_after_its_timeout() -> None:
    """The connectionless path holds no stream whose end would tell of a crash. A node whose pulse session with the
    new leader carried a pulse has found it: silent for its timeout plus CONFIRM_S, it is lost then (n-b), not
    when the grace ends; n-a, which registered but has not reached this leader yet, is kept by the grace."""
    clock = ManualClock()
    live = NodeLiveness(clock, timeout_s=2.5, grace_s=20.0)
    live.reset()
    live.seen("n-a")                      # RegisterNode only
    live.pulsing("n-b")                   # its beat opened a pulse session
    live.held(["n-b"])                    # and its first pulse arrived
    ticking(clock, live, 1.0, beats=("n-b",))
    ticking(clock, live, 2.6)             # n-b's host dies: past its timeout, but not yet CONFIRM_S past it
    assert live.alive(NODES) == {"n-a", "n-b"}
    expiry = live.next_expiry(NODES)
    assert expiry is not None and abs(expiry - (CONFIRM_S - 0.1)) < 1e-6, "the loop wakes when n-b is lost"
    ticking(clock, live, CONFIRM_S)
    assert live.alive(NODES) == {"n-a"}, "n-b lost 4 s after its last pulse, 15 s before the grace ends"
    live.pulsing("n-b")
    assert live.alive(NODES) == {"n-a", "n-b"}, "n-b came back"
    live.opened("n-b")                    # a stream now: its end is n-b's evidence, as for any streamed node
    ticking(clock, live, 5.0)
    assert live.alive(NODES) == {"n-a", "n-b"}, "an open stream without pulses is alive while open"


def test_in_the_grace_a_node_whose_session_never_carried_a_pulse_is_kept_until_the_grace_ends() -> None:
    """On a busy new leader a Beat can open a node's pulse session after the agent's call timed out: the agent never
    got the session, and registers again (silent meanwhile, for as long as the leader's appointment says). Such a
    node has not found the leader, so its silence is not taken as its death during the grace; n-b, whose session
    carried a pulse, is lost after its timeout plus CONFIRM_S."""
    clock = ManualClock()
    live = NodeLiveness(clock, timeout_s=2.5, grace_s=20.0)
    live.reset()
    live.pulsing("n-a")                   # the session's answer never reached n-a's agent
    live.pulsing("n-b")
    live.held(["n-b"])
    ticking(clock, live, 2.5 + CONFIRM_S + 0.1)
    assert live.alive(NODES) == {"n-a"}, "n-b lost; n-a kept by the grace"
    live.seen_many(["n-a"])               # a pulse of n-a's session after all (a drain: proof of life, then held)
    live.held(["n-a"])
    ticking(clock, live, 2.5 + CONFIRM_S - 0.2)
    assert live.alive(NODES) == {"n-a"}, "found now, and silent for less than its timeout plus CONFIRM_S"
    ticking(clock, live, 0.3)
    assert live.alive(NODES) == set(), "then lost as n-b was, long before the grace ends"


def _found_the_leader(grace_s: float) -> tuple[ManualClock, NodeLiveness, tuple[str, ...]]:
    """A new term (node timeout 2.5 s) in which 400 nodes opened a pulse session and pulsed for 1 s."""
    clock = ManualClock()
    live = NodeLiveness(clock, timeout_s=2.5, grace_s=grace_s)
    live.reset()
    fleet = tuple(f"n-{i:03d}" for i in range(400))
    for n in fleet:
        live.pulsing(n)
    live.held(fleet)
    ticking(clock, live, 1.0, beats=fleet)
    return clock, live, fleet


def test_in_the_grace_a_silence_many_nodes_share_waits_for_the_grace_to_end(
        caplog: pytest.LogCaptureFixture) -> None:
    """400 nodes found the new leader; 100 of them (one process driving many agents, starved in the storm) fall
    silent together. That is more than 1 % of those nodes silent at once: none is lost during the grace. When all
    but two come back, the two are lost; the rest of the fleet never was."""
    clock, live, fleet = _found_the_leader(grace_s=30.0)
    stalled, others = fleet[:100], fleet[100:]
    ticking(clock, live, 6.0, beats=others)
    with caplog.at_level(logging.WARNING, logger="trainyard_scheduler.grace"):
        assert live.alive(fleet) == set(fleet), "100 silent together in the grace: the storm's, not 100 deaths"
        assert live.alive(fleet) == set(fleet)
    [held] = [r for r in caplog.records if r.name == "trainyard_scheduler.grace"]
    assert (held.silent_nodes, held.shared_limit, held.found_leader) == (100, 4, 400)  # type: ignore[attr-defined]
    assert live.next_expiry(fleet) is not None
    for n in stalled[2:]:
        live.seen(n)
    assert live.alive(fleet) == set(fleet) - set(stalled[:2]), "two still silent, with few: lost now"
    ticking(clock, live, 30.0, beats=fleet[2:])
    assert live.alive(fleet) == set(fleet[2:]), "after the grace, as before"


def test_the_grace_lasts_while_a_silence_many_share_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    """Every agent has been heard once, so arrivals no longer hold the grace open; but 100 of the 400 nodes that
    found the leader are silent together (the storm is still going on: their agents register again). The grace
    lasts while that goes on, where it used to end `grace_s` (here 5 s) into the term and lose them all; once the
    silence is over (all but two back), it ends a timeout later and the two still silent are lost."""
    clock, live, fleet = _found_the_leader(grace_s=5.0)
    stalled, others = fleet[:100], fleet[100:]
    for _ in range(40):                       # 1 s → 21 s: the shared silence goes on, asked about every 0.5 s
        ticking(clock, live, 0.5, beats=others)
        assert live.alive(fleet) == set(fleet), "held while the storm goes on, past grace_s"
    for n in stalled[2:]:
        live.seen(n)
    assert live.alive(fleet) == set(fleet) - set(stalled[:2]), "two still silent, with few: lost now"
    ticking(clock, live, 3.0, beats=fleet[2:])
    with caplog.at_level(logging.INFO, logger="trainyard_scheduler.grace"):
        assert live.alive(fleet) == set(fleet[2:])
        assert live.alive(fleet) == set(fleet[2:])
    [over] = [r for r in caplog.records if r.getMessage() == "the new leader's grace is over"]
    assert over.nodes_not_alive == 2 and over.found_leader == 400  # type: ignore[attr-defined]
    assert 21.0 < over.grace_s <= 24.0  # type: ignore[attr-defined]  # the silence ended at 21 s, +2.5 s
    live.seen("n-late")                       # a first arrival now: the grace has ended, and does not reopen
    ticking(clock, live, 3.0, beats=fleet[2:])
    assert live.alive((*fleet, "n-late")) == set(fleet[2:])


def test_a_silence_many_share_holds_the_grace_no_longer_than_its_cap() -> None:
    clock, live, fleet = _found_the_leader(grace_s=5.0)
    for _ in range(round((MAX_GRACE_S + 1) / 0.5)):
        ticking(clock, live, 0.5, beats=fleet[100:])
        live.alive(fleet)
    assert live.alive(fleet) == set(fleet[100:]), "the storm's silence outlasted the longest grace: lost then"


def test_a_node_the_grace_lost_stays_lost_when_a_shared_silence_begins_after_it(
        caplog: pytest.LogCaptureFixture) -> None:
    """n-000 dies and is lost in the grace; then a quarter of the fleet falls silent together (held as the
    storm's). n-000 must not read alive again for that: it stays lost until it is heard from."""
    clock, live, fleet = _found_the_leader(grace_s=40.0)
    ticking(clock, live, 4.1, beats=fleet[1:])
    assert live.alive(fleet) == set(fleet[1:]), "n-000 lost 4 s after its last beat"
    ticking(clock, live, 4.0, beats=fleet[101:])      # n-001..n-100 stall together
    with caplog.at_level(logging.WARNING, logger="trainyard_scheduler.grace"):
        assert live.alive(fleet) == set(fleet[1:]), "100 silent together are held; n-000 stays lost"
    live.pulsing("n-000")
    assert live.alive(fleet) == set(fleet), "n-000 heard from again"
    assert any(r.name == "trainyard_scheduler.grace" for r in caplog.records)


def test_a_grace_that_ended_does_not_open_again_for_a_late_first_arrival() -> None:
    clock = ManualClock()
    live = NodeLiveness(clock, timeout_s=2.5, grace_s=5.0)
    live.reset()
    live.seen("n-a")
    ticking(clock, live, 8.0)                 # the grace ended at 5 s; n-a has been silent for 8 s
    assert live.alive(NODES) == frozenset()
    live.seen("n-b")                          # a node heard for the first time in this term, after the grace
    assert live.alive(NODES) == {"n-b"}, "n-a stays lost: the grace is over for good"


def test_the_grace_lasts_while_agents_keep_calling_to_register_even_unserved() -> None:
    """A new leader that cannot serve registrations (the store does not answer its writes, or it refuses them while
    busy) hears nobody new, though the agents keep calling: each RegisterNode call holds the grace open
    (`knocking`), up to MAX_GRACE_S. Once calls stop for a timeout it ends, and the few nodes still unheard (5 of
    100: too few to hold it, `test_the_grace_does_not_end_while_it_would_lose_many_at_once`) are lost."""
    clock = ManualClock()
    live = NodeLiveness(clock, timeout_s=2.5, grace_s=5.0)
    live.reset()
    fleet = tuple(f"n-{i:02d}" for i in range(100))
    heard = fleet[:95]
    for n in heard:
        live.seen(n)
    for _ in range(20):                       # 0 → 20 s: agents call every second; none is served
        ticking(clock, live, 1.0, beats=heard)
        live.knocking()
        assert live.alive(fleet) == set(fleet), "kept while agents keep calling, past grace_s"
    ticking(clock, live, 2.4, beats=heard)
    assert live.alive(fleet) == set(fleet)
    ticking(clock, live, 0.2, beats=heard)
    assert live.alive(fleet) == set(heard), "no call for a timeout: the grace is over, the unheard are lost"
    live.knocking()
    assert live.alive(fleet) == set(heard), "a call after the grace's end does not open it again"


def test_the_grace_does_not_end_while_it_would_lose_many_at_once(caplog: pytest.LogCaptureFixture) -> None:
    """At 5,000 simulated agents a new leader whose etcd was starved served 34 registrations in its first 12 s, and
    the grace's end lost 4,966 live nodes at once. More than a tenth of the registered nodes unheard at once says
    the leader cannot hear the fleet: the grace goes on (MAX_GRACE_S at most), and says so once."""
    clock = ManualClock()
    live = NodeLiveness(clock, timeout_s=2.5, grace_s=5.0)
    live.reset()
    fleet = tuple(f"n-{i:02d}" for i in range(100))
    heard = fleet[:89]                        # 11 unheard: more than a tenth
    for n in heard:
        live.seen(n)
    with caplog.at_level(logging.WARNING, logger="trainyard_scheduler.grace"):
        for _ in range(round(MAX_GRACE_S) - 1):
            ticking(clock, live, 1.0, beats=heard)
            assert live.alive(fleet) == set(fleet), "held: the leader, not 11 % of the fleet, is likely at fault"
    [said] = [r for r in caplog.records if r.name == "trainyard_scheduler.grace"]
    assert (said.nodes_not_heard, said.nodes_registered) == (11, 100)  # type: ignore[attr-defined]
    ticking(clock, live, 1.1, beats=heard)
    assert live.alive(fleet) == set(heard), "the longest grace is over: lost then"
    live.seen(fleet[95])
    assert live.alive(fleet) == {*heard, fleet[95]}


def test_a_grace_that_would_lose_a_tenth_or_fewer_ends_as_it_would() -> None:
    clock = ManualClock()
    live = NodeLiveness(clock, timeout_s=2.5, grace_s=5.0)
    live.reset()
    fleet = tuple(f"n-{i:02d}" for i in range(100))
    heard = fleet[:90]                        # 10 unheard: a tenth
    for n in heard:
        live.seen(n)
    ticking(clock, live, 5.1, beats=heard)
    assert live.alive(fleet) == set(heard)


def test_calls_to_register_hold_the_grace_no_longer_than_its_cap() -> None:
    clock = ManualClock()
    live = NodeLiveness(clock, timeout_s=2.5, grace_s=5.0)
    live.reset()
    for _ in range(round(MAX_GRACE_S) + 2):
        ticking(clock, live, 1.0)
        live.knocking()
    assert live.alive(NODES) == frozenset(), "never heard, and the longest grace is over"


def test_what_nodes_run_is_kept_for_the_busy_ones_and_cleared_with_the_term_and_a_forgotten_node() -> None:
    clock = ManualClock()
    live = NodeLiveness(clock, timeout_s=3.0)
    live.reports.report("node-a", frozenset({("job-1", 1)}))
    clock.advance(1.0)
    live.reports.report("node-b", frozenset())  # runs nothing: only its report's time is kept
    assert live.reports.running() == {"node-a": frozenset({("job-1", 1)})}
    at = live.reports.reported_at()
    assert set(at) == {"node-a", "node-b"} and at["node-b"] - at["node-a"] == pytest.approx(1.0)
    live.reports.report("node-a", frozenset())  # its gang ended
    assert live.reports.running() == {}
    live.reports.report("node-a", frozenset({("job-2", 1)}))
    live.forget("node-a")
    assert live.reports.running() == {} and "node-a" not in live.reports.reported_at()
    live.reports.report("node-c", frozenset({("job-3", 1)}))
    live.reset()  # a new term: what agents said to the last one is not taken for what they run now
    assert live.reports.running() == {} and live.reports.reported_at() == {}
