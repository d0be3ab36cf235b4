"""The agent between two sessions with a busy leader (report.py): an ended session's pulses go on while the agent
registers again, and a first beat that timed out is sent again rather than costing a new registration.

A scripted NodeService stands in for a leader busy with a failover's registrations, so the test controls what a
real one only does under load: pulses left unacknowledged, registrations refused with an appointment, a Beat
answered after the caller's deadline."""

from __future__ import annotations

import asyncio
import secrets
import socket
import time
from dataclasses import dataclass, field

import pytest

from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_agent import report
from trainyard_agent.pulse import Pulser
from trainyard_agent.report import Reporter
from trainyard_core.clock import ManualClock
from trainyard_core.errors import Busy
from trainyard_core.rpc import pulse
from trainyard_core.rpc.server import GrpcServer
from trainyard_core.testing.wait import eventually, truthy

from .agent_kit import scripted_reporter


@dataclass
class ScriptedLeader(scheduler_pb2_grpc.NodeServiceServicer):  # type: ignore[misc]
    """Registrations answered in turn from `registrations` (None: accepted; a number: refused with that
    appointment); each first beat opens a new pulse session; pulses are noted as (time, session) and
    acknowledged while `acking`. `slow_first_beats`: how many first beats are answered only after `slow_s`."""

    registrations: list[float | None]
    slow_first_beats: int = 0
    slow_s: float = 0.0
    acking: bool = True
    came: list[float] = field(default_factory=list)
    first_beats: int = 0
    keys: dict[int, bytes] = field(default_factory=dict)
    pulses: list[tuple[float, int]] = field(default_factory=list)

    async def RegisterNode(self, request: scheduler_pb2.RegisterNodeRequest,
                           context: object) -> scheduler_pb2.RegisterNodeResponse:
        self.came.append(time.monotonic())
        answer = self.registrations.pop(0) if self.registrations else None
        if answer is not None:
            raise Busy("this server is busy with 4000 calls of RegisterNode", retry_after_s=answer)
        return scheduler_pb2.RegisterNodeResponse(leader_epoch=1, heartbeat_interval_ms=30_000)

    async def Beat(self, request: scheduler_pb2.HeartbeatRequest,
                   context: object) -> scheduler_pb2.HeartbeatResponse:
        answer = scheduler_pb2.HeartbeatResponse(ack_seq=request.seq, leader_epoch=1)
        if request.leaving or request.pulse_session:
            return answer
        self.first_beats += 1
        if self.first_beats <= self.slow_first_beats:
            await asyncio.sleep(self.slow_s)  # the session is opened, but the answer comes after the deadline
        session = secrets.randbits(31) + 1
        self.keys[session] = secrets.token_bytes(pulse.KEY_BYTES)
        answer.pulse_session, answer.pulse_key = session, self.keys[session]
        answer.pulse_interval_ms = 200
        return answer

    def datagram(self, data: bytes, addr: tuple[str, int], transport: asyncio.DatagramTransport) -> None:
        session = pulse.peek_session(data)
        key = self.keys.get(session or 0)
        got = pulse.verify(data, key, pulse.PULSE) if key is not None else None
        if got is None or key is None:
            return
        self.pulses.append((time.monotonic(), got.session))
        if self.acking:
            transport.sendto(pulse.encode(pulse.ACK, got.session, got.seq, key), addr)

    def sessions(self) -> list[int]:
        """The sessions pulses came from, in the order each first came."""
        return list(dict.fromkeys(s for _, s in self.pulses))


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, leader: ScriptedLeader) -> None:
        self.leader = leader
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        assert self.transport is not None
        self.leader.datagram(data, addr, self.transport)


async def _running(leader: ScriptedLeader) -> tuple[Reporter, GrpcServer, asyncio.DatagramTransport]:
    reporter, server = await scripted_reporter(leader)
    loop = asyncio.get_running_loop()
    udp, _ = await loop.create_datagram_endpoint(lambda: _Udp(leader), local_addr=("127.0.0.1", server.port))
    return reporter, server, udp


async def test_an_ended_sessions_pulses_go_on_while_the_agent_registers_again() -> None:
    """The leader stops acknowledging (busy, not gone): after RECONNECT_AFTER_S the agent ends its session and
    registers again, and is refused with a 3 s appointment. Meanwhile the old session's pulses still reach the
    leader, which still holds that session, so the node is not silent while it waits; once its new session
    opens, only the new session pulses."""
    leader = ScriptedLeader(registrations=[None, 3.0])
    reporter, server, udp = await _running(leader)
    try:
        await eventually(lambda: truthy(len(leader.sessions()) == 1), timeout=10, what="the first session's pulses")
        leader.acking = False
        await eventually(lambda: truthy(len(leader.came) == 2), timeout=10, what="a second registration")
        refused_at = leader.came[1]
        leader.acking = True
        await eventually(lambda: truthy(len(leader.came) == 3 and len(leader.sessions()) == 2), timeout=10,
                         what="the session after the appointment")
        [old, new] = leader.sessions()
        back_at = leader.came[2]
        assert back_at - refused_at >= 3.0, "the appointment was kept"
        waiting = [t for t, s in leader.pulses if s == old and refused_at < t < back_at]
        assert len(waiting) >= 10, f"the old session pulsed {len(waiting)} times in the 3 s wait (every 0.2 s)"
        new_began = min(t for t, s in leader.pulses if s == new)
        await eventually(lambda: truthy(sum(s == new for _, s in leader.pulses) >= 5), timeout=10,
                         what="five pulses of the new session")
        assert not [t for t, s in leader.pulses if s == old and t > new_began + 0.1], "the old session ended"
        assert reporter.lingering is None and reporter.registrations == 2
    finally:
        await reporter.stop()
        udp.close()
        await server.server.stop(grace=0)
    assert reporter.lingering is None


async def test_a_first_beat_that_timed_out_is_sent_again_not_registered_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a busy leader the first beat (which opens the pulse session) can be answered after the agent's deadline.
    The agent sends it again instead of registering again (which would put it at the back of the appointments)."""
    monkeypatch.setattr(report, "RPC_TIMEOUT_S", 0.5)
    leader = ScriptedLeader(registrations=[None], slow_first_beats=1, slow_s=1.0)
    reporter, server, udp = await _running(leader)
    try:
        await eventually(lambda: truthy(leader.sessions()), timeout=10, what="pulses")
        assert leader.first_beats == 2 and len(leader.came) == 1 and reporter.registrations == 1
    finally:
        await reporter.stop()
        udp.close()
        await server.server.stop(grace=0)


async def test_a_detached_pulser_pulses_once_an_interval_and_never_says_the_leader_went_silent() -> None:
    """A pulser of an ended session goes on pulsing (the leader may still hold the session) but no longer sends a
    pulse twice when it is not acknowledged, nor calls `on_silent`: the session it would end is over. Beside it, an
    attached pulser in the same unanswered silence does both."""
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # receives, never answers
    sink.bind(("127.0.0.1", 0))
    port = sink.getsockname()[1]
    clock = ManualClock()
    silent: list[str] = []
    pulsers = {name: Pulser(host="127.0.0.1", port=port, session=7, key=bytes(pulse.KEY_BYTES), interval_s=0.1,
                            clock=clock, on_silent=lambda name=name: silent.append(name))  # type: ignore[misc]
               for name in ("attached", "detached")}
    pulsers["detached"].detach()
    clock.advance(pulse.RECONNECT_AFTER_S + 1)  # nothing acknowledged since they started, longer than that
    for p in pulsers.values():
        await p.start()
    try:
        # Three intervals of each: the attached one has sent its second pulses and said silent by then.
        await eventually(lambda: truthy(silent and all(p.sent >= 3 for p in pulsers.values())
                                        and pulsers["attached"].retries >= 3), timeout=10, what="three intervals")
    finally:
        for p in pulsers.values():
            await p.stop()
        sink.close()
    assert silent == ["attached"]
    assert pulsers["attached"].retries >= 3 and pulsers["detached"].retries == 0
    assert pulsers["detached"].sent >= 3
