"""The partial-partition definition, held deterministically on a real cluster whose every node and service has a
host of its own (root only; skipped elsewhere with the reason):

- A node is alive only while the scheduler leader hears it. Cut from the leader's host, with the standby's
  still reachable (a standby refuses the agent's stream and relays nothing), the node is lost within the node
  deadline: its gang is stopped and runs again on the other node, its old workers are dead within the worker
  fence, never beside the new attempt; healed, the node is ready again.
- Latency (a round trip under 1 s, well inside the 2 s pulse acknowledgement window) is not a loss: the leader
  never shows the slow node not ready, no gang is stopped for it, and a gang on it runs to its end at its
  first attempt — its agent freshly started, so its exit reports need a connection opened over the slow link.

Waits are probes with deadlines (the deadline and a margin for this shared machine), never sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import httpx
import pytest

from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_cli.local import LocalCluster
from trainyard_core.rpc.pulse import ACK_WINDOW_S  # the lease stops being renewed this soon after the cut
from trainyard_core.security import identity
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.testing import netns
from trainyard_core.testing.linkfaults import Impairment, Peer
from trainyard_core.testing.wait import eventually
from trainyard_scheduler.settings import SchedulerSettings
from trainyard_scheduler.state.keys import Keys

from . import procs
from .invariants import Checker
from .workload import MARKER

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))]

DEFAULTS = SchedulerSettings.model_fields
NODE_TIMEOUT_S = float(DEFAULTS["node_timeout_s"].default)
WORKER_FENCE_S = float(DEFAULTS["worker_fence_s"].default)
LEADER_GRACE_S = float(DEFAULTS["leader_grace_s"].default)
# This machine is shared by several test runs on 2 cores: room on top of each deadline, not a target.
MARGIN_S = 4.0
RUN_ID = f"partitions-{os.getpid()}"
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(Path(tmp_path_factory.mktemp("partitions")), gateway_port=0, stop_grace_s=2.0,
                     log_format="text", etcd_members=1, schedulers=2, control_plane_netns=True,
                     node_timeout_s=NODE_TIMEOUT_S, heartbeat_interval_ms=DEFAULTS["heartbeat_interval_ms"].default,
                     nodes=[("node-1", "a100x4"), ("node-2", "a100x4")])
    try:
        c.start()
        c.started_at = time.monotonic()  # type: ignore[attr-defined]
        yield c
    finally:
        if c.network is not None:
            c.network.heal_all()
        c.stop()


class Probe:
    """What the test reads: the gateway, etcd (as root), the leader's node view."""

    def __init__(self, cluster: LocalCluster, store: EtcdStore, http: httpx.AsyncClient) -> None:
        self.cluster, self.store, self.http = cluster, store, http
        self.keys = Keys()
        self.channels: dict[str, grpc.aio.Channel] = {}

    async def leader(self) -> str:
        kv = await self.store.get(self.keys.leader)
        return kv.value.decode() if kv else ""

    async def nodes(self) -> dict[str, types_pb2.Node]:
        """The nodes as the leader sees them ({} while no leader answers)."""
        leader = await self.leader()
        if not leader:
            return {}
        if leader not in self.channels:
            self.channels[leader] = self.cluster.channel(leader, identity.SCHEDULER)
        try:
            resp = await scheduler_pb2_grpc.NodeServiceStub(self.channels[leader]).ListNodes(
                scheduler_pb2.ListNodesRequest(), timeout=3)
        except grpc.aio.AioRpcError:
            return {}
        return {n.node_id: n for n in resp.nodes}

    async def states(self) -> dict[str, int]:
        """node → NodeState as the leader sees it ({} while no leader answers)."""
        return {node_id: n.state for node_id, n in (await self.nodes()).items()}

    async def registered_now(self, node: str) -> bool:
        """The leader has `node` ready at the address of its agent process of now (not of one before it)."""
        proc = self.cluster.procs[node]
        address = f"{self.cluster.address_of(node)}:{proc.ports.get('grpc_port')}"
        n = (await self.nodes()).get(node)
        return n is not None and n.state == types_pb2.NODE_STATE_READY and n.agent_address == address

    async def job(self, job_id: str) -> dict[str, Any]:
        r = await self.http.get(f"/v1/jobs/{job_id}")
        assert r.status_code == 200, r.text
        return dict(r.json())

    async def submit(self, name: str, command: list[str], nodes: int) -> dict[str, Any]:
        r = await self.http.post("/v1/jobs", json={"name": name, "command": command, "env": {MARKER: RUN_ID},
                                                  "resources": {"nodes": nodes, "gpus_per_node": 1}})
        assert r.status_code == 201, r.text
        return dict(r.json())

    async def all_ready(self) -> bool:
        states = await self.states()
        return len(states) == len(self.cluster.nodes) and all(
            s == types_pb2.NODE_STATE_READY for s in states.values())


@pytest.fixture
async def probe(cluster: LocalCluster) -> AsyncIterator[Probe]:
    store = EtcdStore.from_options(cluster.etcd_options(), timeout=2.0)
    http = httpx.AsyncClient(base_url=cluster.url, headers={"Authorization": f"Bearer {cluster.token}"}, timeout=10)
    p = Probe(cluster, store, http)
    try:
        await eventually(p.all_ready, timeout=60, what="every node ready")
        # A new leader loses a silent node only once its grace is over (architecture.md, "Leader election and
        # fencing"): the grace began by the time the cluster had started and lasts leader_grace_s, longer
        # while agents kept registering (until none arrived for node_timeout_s; every node is ready now). A
        # node cut before then is lost at the grace's end, not at its deadline, so the tests begin after it.
        grace_over = max(getattr(cluster, "started_at", 0.0) + LEADER_GRACE_S, time.monotonic() + NODE_TIMEOUT_S)
        await asyncio.sleep(max(0.0, grace_over + 0.5 - time.monotonic()))
        yield p
    finally:
        for channel in p.channels.values():
            await channel.close()
        await http.aclose()
        await store.close()


def _connects(net: netns.HostNetwork, host: str, address: str) -> bool:
    """Whether a TCP connection from `host`'s host to `address` (host:port) opens within a second."""
    ip, port = address.rsplit(":", 1)
    code = ("import socket, sys\ntry:\n    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1)"
            "\n    print('yes')\nexcept OSError:\n    print('no')")
    return net.run_in(host, sys.executable, "-c", code, ip, port).stdout.strip() == "yes"


@contextlib.asynccontextmanager
async def watching(checker: Checker) -> AsyncIterator[None]:
    """Invariant (d) — no job runs two attempts at once — checked from /proc and the agents the whole time."""
    stop = asyncio.Event()

    async def loop() -> None:
        while not stop.is_set():
            await checker.check_processes()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)
    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        stop.set()
        await task


async def test_a_node_that_reaches_only_the_standby_is_lost_and_its_gang_moves(cluster: LocalCluster,
                                                                               probe: Probe) -> None:
    net = cluster.network
    assert net is not None
    job = await probe.submit("partial-partition", SLEEPER, nodes=1)
    running = await eventually(lambda: _state(probe, job["id"], "running"), timeout=60, what="the job running")
    [node] = [a["node_id"] for a in running["placement"]]
    [other] = [n for n, _ in cluster.nodes if n != node]
    old = [w for w in procs.workers(MARKER, RUN_ID) if w.job_id == job["id"] and w.attempt == running["attempt"]]
    assert old, "the first attempt's workers are not in /proc"
    leader = await probe.leader()
    [standby] = [a for a in cluster.scheduler_addresses if a != leader]

    checker = Checker(cluster, probe.store, RUN_ID)
    async with watching(checker):
        net.impair(node, Impairment(cut=(Peer(leader.rsplit(":", 1)[0]),)))
        cut_at = asyncio.get_running_loop().time()
        # A partial partition: the standby answers on its port, the leader does not.
        assert await asyncio.to_thread(_connects, net, node, standby)
        assert not await asyncio.to_thread(_connects, net, node, leader)

        async def lost() -> bool:
            return (await probe.states()).get(node) == types_pb2.NODE_STATE_NOT_READY
        await eventually(lost, timeout=NODE_TIMEOUT_S + MARGIN_S,
                         what=f"{node} not ready in the leader's view after being cut from it")
        assert await probe.leader() == leader, "the leader changed: this test needs the cut leader to stay"

        async def old_dead() -> bool:
            return not any(procs.alive(w.pid, w.start_time) for w in old)
        left = cut_at + WORKER_FENCE_S + ACK_WINDOW_S + MARGIN_S - asyncio.get_running_loop().time()
        await eventually(old_dead, timeout=max(left, 0.1),
                         what=f"the old workers {[w.pid for w in old]} on {node} killed by the worker fence")

        async def moved() -> dict[str, Any] | None:
            j = await probe.job(job["id"])
            return j if j["state"] == "running" and j["attempt"] > running["attempt"] else None
        again = await eventually(moved, timeout=WORKER_FENCE_S + 30, what="the job running again")
        assert [a["node_id"] for a in again["placement"]] == [other], again
        assert again["infra_restarts"] == 1 and again["restarts"] == 0, again
        events = " | ".join(e["message"] for e in again["events"])
        assert f"node {node} lost contact" in events, events

        net.heal(node)

        async def ready_again() -> bool:
            return (await probe.states()).get(node) == types_pb2.NODE_STATE_READY
        await eventually(ready_again, timeout=30, what=f"{node} ready again after the heal")
    assert not checker.violations, [v.describe() for v in checker.violations.values()]
    assert checker.stats.get("(d) process scans", 0) > 0
    r = await probe.http.post(f"/v1/jobs/{job['id']}:cancel")
    assert r.status_code in (200, 202), r.text


async def test_latency_on_a_nodes_link_is_not_a_death(cluster: LocalCluster, probe: Probe) -> None:
    net = cluster.network
    assert net is not None
    slow = "node-1"
    # A fresh agent: every connection it opens to the scheduler from here on (its exit reports' own channel)
    # is opened over the slow link, as on a host whose link became slow before it had anything to report.
    await asyncio.to_thread(cluster.restart, slow)
    await eventually(lambda: probe.registered_now(slow), timeout=60, what=f"{slow}'s new agent registered")
    await eventually(probe.all_ready, timeout=60, what="every node ready after the agent's restart")
    # 300 ± 50 ms each way: a round trip of at most 700 ms; pulses arrive late but as often.
    net.impair(slow, Impairment(delay_ms=300.0, jitter_ms=50.0))
    seen: list[int] = []
    unfinished: AssertionError | None = None
    try:
        links = await asyncio.to_thread(socket.if_nameindex)
        assert any(name == net.hosts[slow].tap for _, name in links), "the delay line's tap is not there"
        stop = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                state = (await probe.states()).get(slow)
                if state is not None:
                    seen.append(state)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.2)
        watcher = asyncio.create_task(watch())
        # A gang on both nodes, so the slow one holds a rank; it runs for a dozen keepalive rounds.
        job = await probe.submit("slow-link", [sys.executable, "-c", "import time; time.sleep(12)"], nodes=2)
        try:
            await eventually(lambda: _state(probe, job["id"], "succeeded"), timeout=60,
                             what="the gang across the slow link to succeed")
        except AssertionError as exc:
            unfinished = exc
        finally:
            stop.set()
            await watcher
    finally:
        net.heal(slow)
    done = await probe.job(job["id"])
    # The liveness property first: whatever else went wrong, the slow node was never lost.
    assert seen and all(s == types_pb2.NODE_STATE_READY for s in seen), \
        f"{slow} was seen {sorted({types_pb2.NodeState.Name(s) for s in seen})}"  # type: ignore[arg-type]
    assert "lost contact" not in " | ".join(e["message"] for e in done["events"]), done["events"]
    assert slow in {a["node_id"] for a in done["placement"]}
    if unfinished is not None:
        await probe.http.post(f"/v1/jobs/{job['id']}:cancel")
        log = cluster.procs[slow].log_path.read_text(errors="replace").splitlines()
        complaints = [line for line in log if "cannot report a worker exit" in line and job["id"] in line][-3:]
        raise AssertionError(f"{unfinished}; the job is {done['state']}: {done['message']}; {slow}'s agent says: "
                             + (" | ".join(complaints) or "nothing about its exit reports"))
    assert done["attempt"] == 1 and done["infra_restarts"] == 0, done


async def _state(probe: Probe, job_id: str, state: str) -> dict[str, Any] | None:
    job = await probe.job(job_id)
    if job["state"] in ("failed", "cancelled") and state not in ("failed", "cancelled"):
        raise AssertionError(f"job {job_id} ended {job['state']}: {job.get('message')}")
    return job if job["state"] == state else None
