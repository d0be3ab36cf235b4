"""Node liveness as the leader sees it: lost after the timeout and not before — not during a new leader's
grace, and not because this process itself was paused (time it did not run is not a node's silence)."""

from __future__ import annotations

import asyncio

from trainyard_core.clock import ManualClock
from trainyard_scheduler.liveness import TICK_S, NodeLiveness

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
    assert live.alive(NODES) == {"n-a"}, "after the grace only nodes that spoke are alive"
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
