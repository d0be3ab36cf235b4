"""Liveness pulses (trainyard_core.rpc.pulse): the wire format and its authentication, the leader's sessions,
and an agent's Pulser against the leader's real UDP endpoint."""

from __future__ import annotations

import asyncio
import socket

import pytest

from trainyard_agent.pulse import Pulser
from trainyard_core.clock import ManualClock, SystemClock
from trainyard_core.rpc import pulse
from trainyard_core.testing.wait import eventually, truthy
from trainyard_scheduler import metrics
from trainyard_scheduler.grace import CONFIRM_S
from trainyard_scheduler.liveness import TICK_S, NodeLiveness
from trainyard_scheduler.pulses import PulseSessions, start_endpoint

KEY = bytes(range(32))


def test_a_datagram_verifies_only_with_its_key_and_its_kind() -> None:
    data = pulse.encode(pulse.PULSE, 7, 42, KEY)
    assert len(data) == pulse.SIZE
    assert pulse.peek_session(data) == 7
    assert pulse.verify(data, KEY, pulse.PULSE) == pulse.Datagram(pulse.PULSE, 7, 42)
    assert pulse.verify(data, bytes(32), pulse.PULSE) is None, "another session's key"
    assert pulse.verify(data, KEY, pulse.ACK) is None, "a pulse reflected back is not an acknowledgement"
    flipped = bytearray(data)
    flipped[10] ^= 1
    assert pulse.verify(bytes(flipped), KEY, pulse.PULSE) is None, "a changed sequence"
    assert pulse.verify(data[:-1], KEY, pulse.PULSE) is None and pulse.peek_session(data[:-1]) is None
    assert pulse.peek_session(b"\x02" + data[1:]) is None, "another version"


def _count(result: str) -> float:
    return metrics.PULSES.labels(result)._value.get()


def _run(clock: ManualClock, live: NodeLiveness, seconds: float) -> None:
    """The leader's loop runs normally meanwhile (its ticker ticks: the time is not a pause of its own)."""
    for _ in range(round(seconds / TICK_S)):
        clock.advance(TICK_S)
        live.tick()


def _leader(timeout_s: float) -> tuple[ManualClock, NodeLiveness, PulseSessions]:
    """A leader's liveness and pulse sessions at the start of a term, on a manual clock."""
    clock = ManualClock()
    live = NodeLiveness(clock, timeout_s=timeout_s, grace_s=0.0)
    live.reset()
    return clock, live, PulseSessions(live)


def _counts() -> dict[str, float]:
    return {r: _count(r) for r in ("accepted", "replayed", "unknown_session", "bad_mac", "malformed")}


def test_the_leader_takes_each_pulse_of_an_open_session_once_and_answers_it() -> None:
    clock, live, sessions = _leader(2.0)
    ident, key = sessions.open("node-1")
    live.opened("node-1", pulsed=True)
    before = _counts()

    _run(clock, live, 1.9)
    ack = sessions.received(pulse.encode(pulse.PULSE, ident, 1, key))
    assert ack is not None and pulse.verify(ack, key, pulse.ACK) == pulse.Datagram(pulse.ACK, ident, 1)
    _run(clock, live, 1.9)
    assert live.alive(["node-1"]) == {"node-1"}, "the pulse 1.9 s ago is its proof of life"
    assert sessions.received(pulse.encode(pulse.PULSE, ident, 1, key)) is None, "a replay"
    assert sessions.received(pulse.encode(pulse.PULSE, ident, 2, bytes(32))) is None, "a forged pulse"
    assert sessions.received(pulse.encode(pulse.PULSE, ident + 1, 3, key)) is None, "no such session"
    assert sessions.received(b"hello") is None
    _run(clock, live, 0.2)
    assert live.alive(["node-1"]) == frozenset(), "none of those was a proof of life"
    assert {r: _count(r) - before[r] for r in before} == {
        "accepted": 1, "replayed": 1, "unknown_session": 1, "bad_mac": 1, "malformed": 1}

    sessions.close(ident)
    assert sessions.received(pulse.encode(pulse.PULSE, ident, 5, key)) is None, "the stream ended"
    again, key2 = sessions.open("node-1")
    sessions.clear()
    assert sessions.received(pulse.encode(pulse.PULSE, again, 1, key2)) is None, "the term ended"
    assert len(sessions) == 0


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_pulser_is_fresh_while_the_leader_answers_and_stale_once_it_stops() -> None:
    live = NodeLiveness(SystemClock(), timeout_s=2.0)
    sessions = PulseSessions(live)
    port = _free_udp_port()
    endpoint = await start_endpoint("127.0.0.1", port, sessions)
    ident, key = sessions.open("node-1")
    pulser = Pulser(host="127.0.0.1", port=port, session=ident, key=key, interval_s=0.1, clock=SystemClock())
    await pulser.start()
    try:
        assert not pulser.fresh(), "nothing acknowledged yet"
        await eventually(lambda: _fresh(pulser), timeout=5.0, what="an acknowledgement")
        assert live.last_seen_age("node-1") is not None
        sessions.clear()  # the leader's term ends: it answers no more
        await asyncio.sleep(pulse.ACK_WINDOW_S + 0.3)
        assert not pulser.fresh(), "no acknowledgement for longer than the window"
        assert pulser.sent > pulser.acks > 0
    finally:
        await pulser.stop()
        endpoint.close()


async def _fresh(p: Pulser) -> bool:
    return p.fresh()


async def test_the_endpoint_says_which_port_it_could_not_take() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"UDP 127.0.0.1:{port}"):
            await start_endpoint("127.0.0.1", port, PulseSessions(NodeLiveness(SystemClock(), 2.0)))


async def test_a_failing_drain_is_logged_and_the_endpoint_keeps_draining(caplog: pytest.LogCaptureFixture) -> None:
    live = NodeLiveness(SystemClock(), timeout_s=2.0)
    sessions = PulseSessions(live)
    port = _free_udp_port()
    endpoint = await start_endpoint("127.0.0.1", port, sessions)
    calls = []

    def broken(datagrams: list[bytes]) -> list[bytes | None]:
        calls.extend(datagrams)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        return [None] * len(datagrams)
    sessions.received_many = broken  # type: ignore[method-assign]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.sendto(b"x", ("127.0.0.1", port))
            await eventually(lambda: truthy(len(calls) == 1), timeout=5.0, what="the first drain")
            s.sendto(b"y", ("127.0.0.1", port))
            await eventually(lambda: truthy(len(calls) == 2), timeout=5.0, what="a drain after the failed one")
        finally:
            endpoint.close()
    assert "pulse endpoint: draining failed" in caplog.text


async def test_a_pulse_not_acknowledged_in_time_is_sent_once_more_not_an_interval_later() -> None:
    """The leader's endpoint drops the first of every pair of pulses (as a lossy link would): each one lost is
    followed by a retry RETRY_AFTER_S later, which is acknowledged, so the pulser stays fresh at one pulse an
    interval; with nothing lost there is no retry at all."""
    live = NodeLiveness(SystemClock(), timeout_s=2.5)
    sessions = PulseSessions(live)
    port = _free_udp_port()
    endpoint = await start_endpoint("127.0.0.1", port, sessions)
    ident, key = sessions.open("node-1")
    answer = sessions.received_many
    dropped = []

    def lossy(datagrams: list[bytes]) -> list[bytes | None]:
        acks: list[bytes | None] = []
        for data in datagrams:
            got = pulse.verify(data, key, pulse.PULSE)
            if got is not None and got.seq % 2 == 1:  # every pulse sent on the interval (the retries are even)
                dropped.append(got.seq)
                acks.append(None)
            else:
                acks.extend(answer([data]))
        return acks
    sessions.received_many = lossy  # type: ignore[method-assign]
    pulser = Pulser(host="127.0.0.1", port=port, session=ident, key=key, interval_s=0.4, clock=SystemClock())
    await pulser.start()
    try:
        await eventually(lambda: truthy(pulser.retries >= 3), timeout=10.0, what="three retries")
        assert pulser.acks >= 2 and pulser.fresh(), "each retry was acknowledged"
        assert len(dropped) >= 3
    finally:
        await pulser.stop()
    sessions.received_many = answer  # type: ignore[method-assign]
    clean = Pulser(host="127.0.0.1", port=port, session=ident, key=key, interval_s=0.4, clock=SystemClock())
    clean._seq = 1000  # above what the session accepted already
    await clean.start()
    try:
        await eventually(lambda: truthy(clean.acks >= 3), timeout=10.0, what="three acknowledgements")
        assert clean.retries == 0, "nothing lost, nothing sent twice"
    finally:
        await clean.stop()
        endpoint.close()


def test_a_batch_is_answered_in_order_and_counted_once_per_outcome() -> None:
    _, live, sessions = _leader(2.5)
    a, key_a = sessions.open("node-a")
    b, key_b = sessions.open("node-b")
    before = _counts()
    nobody = next(i for i in range(1, 10) if i not in (a, b))
    batch = [pulse.encode(pulse.PULSE, a, 1, key_a), b"junk", pulse.encode(pulse.PULSE, b, 1, key_b),
             pulse.encode(pulse.PULSE, a, 1, key_a), pulse.encode(pulse.PULSE, b, 2, key_a),
             pulse.encode(pulse.PULSE, nobody, 1, key_a), pulse.encode(pulse.ACK, a, 2, key_a)]
    acks = sessions.received_many(batch)
    assert [pulse.verify(x, k, pulse.ACK) if x else None for x, k in zip(acks, [key_a, None, key_b] + [None] * 4,
                                                                           strict=True)] == [
        pulse.Datagram(pulse.ACK, a, 1), None, pulse.Datagram(pulse.ACK, b, 1), None, None, None, None]
    assert live.alive(["node-a", "node-b"]) == {"node-a", "node-b"}
    assert {r: _count(r) - before[r] for r in before} == {
        "accepted": 2, "replayed": 1, "unknown_session": 1, "bad_mac": 2, "malformed": 1}
    # The leader's fast MAC and the protocol's own agree both ways.
    mac = pulse.SessionMac(key_a)
    assert mac.ack(a, 7) == pulse.encode(pulse.ACK, a, 7, key_a)
    assert mac.pulse_seq(pulse.encode(pulse.PULSE, a, 9, key_a)) == 9
    assert mac.pulse_seq(pulse.encode(pulse.ACK, a, 9, key_a)) is None, "an acknowledgement is not a pulse"


def test_a_node_has_found_a_new_leader_once_a_pulse_of_its_beat_opened_session_arrives() -> None:
    """In a new leader's grace, a silent node on the connectionless path is lost soon after its timeout only if it
    found the leader (grace.py): the first pulse of the session its Beat opened says its agent holds the session.
    node-1's session carried a pulse; node-2's agent never got its session (the Beat's answer came after its
    deadline); node-3 holds a heartbeat stream, whose end is its evidence instead."""
    clock = ManualClock()
    live = NodeLiveness(clock, timeout_s=2.0, grace_s=20.0)
    live.reset()
    sessions = PulseSessions(live)
    opened = {}
    for node in ("node-1", "node-2"):
        opened[node] = sessions.open(node, sole=True)
        live.pulsing(node)
    streamed, stream_key = sessions.open("node-3")
    live.opened("node-3", pulsed=True)
    ident, key = opened["node-1"]
    assert sessions.received(pulse.encode(pulse.PULSE, ident, 1, key)) is not None
    assert sessions.received(pulse.encode(pulse.PULSE, streamed, 1, stream_key)) is not None
    nodes = ("node-1", "node-2", "node-3")
    _run(clock, live, 2.0 + CONFIRM_S + 0.2)
    assert live.alive(nodes) == {"node-2", "node-3"}, "node-1 found the leader and went silent: lost in the grace"
    _run(clock, live, 20.0)
    assert live.alive(nodes) == frozenset(), "the grace over, silence is death for node-2 and node-3 too"
