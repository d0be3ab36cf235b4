"""NodeService.Beat, the connectionless path's call, and the Heartbeat stream kept for agents of earlier
versions, against the real scheduler over mTLS (docs/architecture.md, "Node liveness"): who holds which pulse
session, and when it ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio

from tests.scheduler.test_stream_liveness import leader  # noqa: F401 - the fixture
from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_core.rpc.server import secure_channel
from trainyard_core.security import identity, pki
from trainyard_core.security.tls import ClientTls
from trainyard_core.testing.wait import eventually
from trainyard_scheduler.app import SchedulerApp


def _stub(app: SchedulerApp, pki_dir: Path, node_id: str) -> tuple[grpc.aio.Channel,
                                                                        scheduler_pb2_grpc.NodeServiceStub]:
    channel = secure_channel(f"127.0.0.1:{app.grpc_port}",
                             ClientTls(pki.files_for(pki_dir, identity.node(node_id))), identity.SCHEDULER)
    return channel, scheduler_pb2_grpc.NodeServiceStub(channel)


async def _register(stub: scheduler_pb2_grpc.NodeServiceStub, node_id: str) -> None:
    node = types_pb2.Node(node_id=node_id, agent_address="127.0.0.1:1")
    await stub.RegisterNode(scheduler_pb2.RegisterNodeRequest(node=node), timeout=10)


async def test_a_session_per_node_named_by_its_beats_and_closed_by_the_leaving_one(
        leader: SchedulerApp, pki_dir: Path) -> None:  # noqa: F811
    channel, stub = _stub(leader, pki_dir, "node-1")
    other_channel, other = _stub(leader, pki_dir, "node-2")
    try:
        await _register(stub, "node-1")
        await _register(other, "node-2")
        first = await stub.Beat(scheduler_pb2.HeartbeatRequest(node_id="node-1", seq=1, pulses=True))
        assert first.pulse_session and len(first.pulse_key) == 32 and not first.reregister
        assert leader.pulses.holds(first.pulse_session, "node-1")
        again = await stub.Beat(scheduler_pb2.HeartbeatRequest(node_id="node-1", seq=2,
                                                                pulse_session=first.pulse_session))
        assert not again.reregister and again.pulse_session == 0 and again.ack_seq == 2

        # Another node naming node-1's session does not get it, and node-1 keeps it.
        foreign = await other.Beat(scheduler_pb2.HeartbeatRequest(node_id="node-2", seq=1,
                                                                  pulse_session=first.pulse_session))
        assert foreign.reregister and leader.pulses.holds(first.pulse_session, "node-1")
        # A session this replica does not hold: register again.
        unknown = await stub.Beat(scheduler_pb2.HeartbeatRequest(node_id="node-1", seq=3,
                                                                  pulse_session=first.pulse_session ^ 1))
        assert unknown.reregister

        # A node's next session replaces its last: one per node, however often it registers.
        second = await stub.Beat(scheduler_pb2.HeartbeatRequest(node_id="node-1", seq=4, pulses=True))
        assert second.pulse_session != first.pulse_session and len(leader.pulses) == 1
        assert not leader.pulses.holds(first.pulse_session, "node-1")

        await stub.Beat(scheduler_pb2.HeartbeatRequest(node_id="node-1", seq=5, leaving=True,
                                                       pulse_session=second.pulse_session))
        assert len(leader.pulses) == 0
        age = leader.liveness.last_seen_age("node-1")
        assert age is not None and age < 1.0
    finally:
        await channel.close()
        await other_channel.close()


async def test_an_unregistered_node_is_told_to_register(leader: SchedulerApp, pki_dir: Path) -> None:  # noqa: F811
    channel, stub = _stub(leader, pki_dir, "node-2")
    try:
        answer = await stub.Beat(scheduler_pb2.HeartbeatRequest(node_id="node-2", seq=1, pulses=True))
        assert answer.reregister and not answer.pulse_session and len(leader.pulses) == 0
    finally:
        await channel.close()


async def test_an_older_agents_stream_still_gets_a_session_that_ends_with_it(
        leader: SchedulerApp, pki_dir: Path) -> None:  # noqa: F811
    channel, stub = _stub(leader, pki_dir, "node-1")
    try:
        await _register(stub, "node-1")

        checked = asyncio.Event()

        async def beats() -> AsyncIterator[scheduler_pb2.HeartbeatRequest]:
            yield scheduler_pb2.HeartbeatRequest(node_id="node-1", seq=1, pulses=True)
            # Keep our side open until the session has been seen: an ended request stream ends the
            # session, and the server may read that end before this test looks.
            await checked.wait()

        call = stub.Heartbeat(beats())
        answer = await call.read()
        assert isinstance(answer, scheduler_pb2.HeartbeatResponse) and answer.pulse_session
        assert leader.pulses.holds(answer.pulse_session, "node-1")
        checked.set()
        # Our side is done (the generator ended): the server ends the stream cleanly, and the session with it.
        assert await call.read() is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK

        async def closed() -> bool:
            return len(leader.pulses) == 0
        # The handler's cleanup runs after the status has gone out.
        await eventually(closed, timeout=5, what="the stream's session to close with it")
    finally:
        await channel.close()
