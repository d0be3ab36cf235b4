"""Node liveness on the connectionless path (docs/architecture.md, "Node liveness"), against the real
scheduler over mTLS, with the agent's traffic going through a proxy that can go silent like a dead host:

- an idle node (no beats for much longer than the node timeout) stays alive on its pulses alone, and holds no
  connection to the leader once its channel has been idle for AGENT_IDLE_S;
- a node whose link goes silent (no FIN, no reset) is lost: its pulses stop, the agent stops renewing its
  worker lease, and it comes back once the link does;
- a scheduler whose event loop is blocked for seconds keeps its nodes (the pause is not their silence);
- a leader that loses its term closes every pulse session, and the agents register again;
- an agent that stops ends its session with a leaving beat.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
import pytest

from tests.scheduler.test_scheduler_tls import agent_settings, sched_settings
from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_agent.app import AgentApp, scheduler_channel
from trainyard_core.rpc.liveness import AGENT_IDLE_S
from trainyard_core.rpc.pulse import ACK_WINDOW_S, RECONNECT_AFTER_S
from trainyard_core.rpc.server import secure_channel
from trainyard_core.security import identity, pki
from trainyard_core.security.tls import ClientTls
from trainyard_core.testing.blackhole import BlackholeProxy
from trainyard_core.testing.wait import eventually, truthy
from trainyard_scheduler.app import SchedulerApp
from trainyard_scheduler.settings import SchedulerSettings

NODE = identity.node("node-1")


NODE_TIMEOUT_S = SchedulerSettings.model_fields["node_timeout_s"].default
HEARTBEAT_INTERVAL_MS = SchedulerSettings.model_fields["heartbeat_interval_ms"].default


@pytest.fixture
async def leader(etcd_settings: dict[str, str], key_prefix: str, pki_dir: Path) -> AsyncIterator[SchedulerApp]:
    # The defaults of liveness: a refresh beat every 5 minutes, lost 2.5 s without proof of life.
    settings = sched_settings(etcd_settings, key_prefix.rstrip("/"), pki.files_for(pki_dir, identity.SCHEDULER))
    # A lease longer than the blocked-loop test's pause, so that test pauses liveness and not the election.
    settings = settings.model_copy(update={"node_timeout_s": NODE_TIMEOUT_S,
                                           "heartbeat_interval_ms": HEARTBEAT_INTERVAL_MS, "leader_ttl_s": 5})
    app = SchedulerApp(settings)
    await app.start()

    async def leads() -> bool:
        return app.leadership.is_leader

    await eventually(leads, what="the scheduler to lead")
    try:
        yield app
    finally:
        await app.stop()


@pytest.fixture
async def proxy(leader: SchedulerApp) -> AsyncIterator[BlackholeProxy]:
    p = await BlackholeProxy("127.0.0.1", leader.grpc_port).start()
    try:
        yield p
    finally:
        await p.close()


@pytest.fixture
async def agent(tmp_path: Path, pki_dir: Path, proxy: BlackholeProxy) -> AsyncIterator[AgentApp]:
    files = pki.files_for(pki_dir, NODE)
    settings = agent_settings(tmp_path, "node-1", proxy.address, files)
    app = AgentApp(settings, connect=scheduler_channel(proxy.address, ClientTls(files)))
    await app.start()
    try:
        yield app
    finally:
        await app.stop()


@pytest.fixture
async def direct_agent(tmp_path: Path, pki_dir: Path, leader: SchedulerApp) -> AsyncIterator[AgentApp]:
    """An agent connected to the leader without the proxy (which is Python, and would pause with the loop)."""
    app = AgentApp(agent_settings(tmp_path, "node-1", f"127.0.0.1:{leader.grpc_port}",
                                  pki.files_for(pki_dir, NODE)))
    await app.start()
    try:
        yield app
    finally:
        await app.stop()


async def ready(leader: SchedulerApp, pki_dir: Path, node_id: str = "node-1") -> bool:
    channel = secure_channel(f"127.0.0.1:{leader.grpc_port}", ClientTls(pki.files_for(pki_dir, identity.GATEWAY)),
                             identity.SCHEDULER)
    try:
        try:
            got = await scheduler_pb2_grpc.NodeServiceStub(channel).GetNode(
                scheduler_pb2.GetNodeRequest(node_id=node_id))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return False  # not registered (yet)
            raise
        return bool(got.node.state == types_pb2.NODE_STATE_READY)
    finally:
        await channel.close()


async def until_state(leader: SchedulerApp, pki_dir: Path, want: bool, what: str, timeout: float = 15.0) -> None:
    async def probe() -> bool:
        return await ready(leader, pki_dir) == want
    await eventually(probe, timeout=timeout, what=what)


def _pulsing(leader: SchedulerApp, agent: AgentApp) -> bool:
    """The leader holds the agent's current pulse session."""
    reporter = agent.reporter
    return bool(reporter is not None and reporter.pulser is not None
                and leader.pulses.holds(reporter.pulser.session, "node-1"))


async def test_an_idle_node_stays_alive_and_a_silent_link_loses_it(leader: SchedulerApp, agent: AgentApp,
                                                                   proxy: BlackholeProxy, pki_dir: Path) -> None:
    assert agent.reporter is not None and agent.supervisor is not None
    await until_state(leader, pki_dir, True, "node-1 to be ready")
    await eventually(lambda: truthy(_pulsing(leader, agent)), what="node-1's pulse session to be open")
    seq = agent.reporter.seq
    lease = agent.supervisor.lease_path
    renewed = lease.stat().st_mtime_ns
    # Without a change, the agent's channel drops its connection to the leader after AGENT_IDLE_S: the leader
    # holds nothing per node but the session, and the node stays alive on its pulses alone.
    await eventually(lambda: truthy(proxy.open_connections == 0), timeout=AGENT_IDLE_S + 10,
                     what="the agent's idle connection to the leader to close")
    assert agent.reporter.seq == seq, "no beat was needed for that"
    # Three node timeouts more without a beat (the refresh is every 5 minutes): its pulses keep it alive, and
    # the leader's acknowledgements keep its worker lease renewed.
    for _ in range(6):
        await asyncio.sleep(1.0)
        assert await ready(leader, pki_dir), "an idle node that pulses must stay ready"
    assert agent.reporter.seq == seq and proxy.open_connections == 0
    assert len(leader.pulses) == 1 and agent.reporter.pulser is not None and agent.reporter.pulser.acks >= 5
    assert lease.stat().st_mtime_ns > renewed, "the lease is renewed while the leader acknowledges pulses"

    proxy.cut()   # the host goes dark: no FIN, no reset
    cut_at = time.monotonic()
    await until_state(leader, pki_dir, False, "node-1 to be lost after its link went silent")
    assert time.monotonic() - cut_at < NODE_TIMEOUT_S + 1.5, "lost about a node timeout after its last pulse"
    # No acknowledgement comes back: the lease stops being renewed within the acknowledgement window.
    await asyncio.sleep(ACK_WINDOW_S + 0.5)
    stopped = lease.stat().st_mtime_ns
    await asyncio.sleep(1.0)
    assert lease.stat().st_mtime_ns == stopped, "the worker lease must run down while the leader is unreachable"
    # Its pulses unanswered, the agent ends its session: it looks for a leader again.
    registrations = agent.reporter.registrations
    await eventually(lambda: truthy(agent.reporter is not None and agent.reporter.pulser is None),
                     what="the agent to notice the dead link", timeout=RECONNECT_AFTER_S + 3)

    proxy.heal()
    await until_state(leader, pki_dir, True, "node-1 to be back once its link is", timeout=30.0)
    # Back by registering again: the leader marks it ready on the registration, before the agent has read the
    # answer and counted it.
    await eventually(lambda: truthy(agent.reporter is not None and agent.reporter.registrations > registrations),
                     what="the agent to count its new registration")


async def test_a_health_change_reaches_the_leader_over_a_closed_connection(
        leader: SchedulerApp, agent: AgentApp, proxy: BlackholeProxy, pki_dir: Path) -> None:
    """The beat of a change opens a connection when none is held (a TLS handshake), well within the 1 s a
    health event has to reach the leader."""
    assert agent.reporter is not None and agent.overrides is not None
    await until_state(leader, pki_dir, True, "node-1 to be ready")
    await eventually(lambda: truthy(proxy.open_connections == 0 and _pulsing(leader, agent)),
                     timeout=AGENT_IDLE_S + 10, what="the agent's idle connection to close")
    started = time.monotonic()
    agent.overrides.set_health(2, healthy=False, operator="alice", reason="reseated, to be checked")

    async def unhealthy() -> bool:
        channel = secure_channel(f"127.0.0.1:{leader.grpc_port}",
                                 ClientTls(pki.files_for(pki_dir, identity.GATEWAY)), identity.SCHEDULER)
        try:
            got = await scheduler_pb2_grpc.NodeServiceStub(channel).GetNode(
                scheduler_pb2.GetNodeRequest(node_id="node-1"))
        finally:
            await channel.close()
        return bool(got.node.gpus[2].health == types_pb2.GPU_HEALTH_UNHEALTHY)

    await eventually(unhealthy, timeout=5.0, interval=0.05, what="the leader to store GPU 2 unhealthy")
    assert time.monotonic() - started < 1.0


async def test_a_blocked_scheduler_loop_keeps_its_nodes(leader: SchedulerApp, direct_agent: AgentApp,
                                                         pki_dir: Path) -> None:
    agent = direct_agent
    assert agent.reporter is not None
    await until_state(leader, pki_dir, True, "node-1 to be ready")
    await eventually(lambda: truthy(_pulsing(leader, agent)), what="node-1's pulse session to be open")
    registrations = agent.reporter.registrations
    # The scheduler's event loop (here also the agent's) does not run for 3 s (a long GC pause, a CPU-starved
    # host): the pause is not the node's silence.
    time.sleep(3.0)  # noqa: ASYNC251 - blocking the loop is the point
    await asyncio.sleep(0.5)
    assert await ready(leader, pki_dir)
    assert _pulsing(leader, agent)
    assert agent.reporter.registrations == registrations, "the agent did not have to register again"


async def test_a_lost_term_closes_every_session(leader: SchedulerApp, agent: AgentApp, pki_dir: Path) -> None:
    assert agent.reporter is not None
    await until_state(leader, pki_dir, True, "node-1 to be ready")
    await eventually(lambda: truthy(_pulsing(leader, agent)), what="node-1's pulse session to be open")
    registrations = agent.reporter.registrations
    leader._node_servicer.end_streams()
    assert len(leader.pulses) == 0
    # Its pulses unanswered, the agent registers again (with the same leader, which still leads).
    await eventually(lambda: truthy(agent.reporter is not None and agent.reporter.registrations > registrations),
                     what="the agent to register again", timeout=RECONNECT_AFTER_S + 5)
    await eventually(lambda: truthy(_pulsing(leader, agent)), what="a new pulse session")


async def test_a_stopping_agent_ends_its_session_cleanly(leader: SchedulerApp, agent: AgentApp,
                                                         pki_dir: Path) -> None:
    await until_state(leader, pki_dir, True, "node-1 to be ready")
    await eventually(lambda: truthy(_pulsing(leader, agent)), what="node-1's pulse session to be open")
    assert agent.reporter is not None
    await agent.reporter.stop()
    assert len(leader.pulses) == 0, "the leaving beat closed the session"
    # A clean end counts from the end itself.
    age = leader.liveness.last_seen_age("node-1")
    assert age is not None and age < 0.5
    assert await ready(leader, pki_dir)
    await until_state(leader, pki_dir, False, "node-1 to be lost a node timeout after it left")
