"""Node calls through a gateway whose channel is on the standby scheduler reach the leader.

Only the leader serves NodeService (it alone hears the agents' heartbeats); a standby refuses with
UNAVAILABLE, naming the leader when it knows it. The gateway is given both replicas, the standby first, so
its pick_first channel is on the standby — the state the control-plane suite found answering 503 to
`GET /v1/nodes`, the cordon and job logs while a leader existed. Real schedulers, a real agent, real etcd.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
import httpx
import pytest

from tests.core.store_faults import FaultyStore
from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.store.etcd_options import EtcdOptions
from trainyard_core.testing.wait import eventually, truthy
from trainyard_scheduler.app import SchedulerApp

from .support import Cluster, RunningGateway, running_cluster, running_gateway


@pytest.fixture
async def leader(etcd_settings: dict[str, str], key_prefix: str, tmp_path: Path) -> AsyncIterator[Cluster]:
    """The first replica, leading, with one agent (node-a) registered to it."""
    async with running_cluster(etcd=etcd_settings, prefix=key_prefix + "cluster",
                               state_root=tmp_path / "nodes", agents={"node-a": "a100x4"}) as cluster:
        assert cluster.scheduler.leadership.is_leader
        yield cluster


async def start_standby(leader: Cluster, store: FaultyStore | None = None) -> SchedulerApp:
    standby = SchedulerApp(leader.settings, store=store)
    await standby.start()
    return standby


async def stop_standby(standby: SchedulerApp, store: FaultyStore | None = None) -> None:
    await standby.stop()
    if store is not None:
        await store.close()


async def refusal(standby: SchedulerApp) -> tuple[grpc.StatusCode, str]:
    """How the standby answers a node call itself: its status and the leader it names ('' for nobody)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{standby.grpc_port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await scheduler_pb2_grpc.NodeServiceStub(channel).ListNodes(scheduler_pb2.ListNodesRequest(), timeout=5)
    return info.value.code(), str(dict(info.value.trailing_metadata() or ()).get("trainyard-leader", ""))


async def node_calls_answer(gw: RunningGateway) -> None:
    """The node list, one node, a cordon and an uncordon: each answered by the leader."""
    async with gw.client(gw.admin_token) as http:
        listed = await http.get("/v1/nodes")
        assert listed.status_code == 200, listed.text
        assert [n["node_id"] for n in listed.json()["nodes"]] == ["node-a"]
        node = await http.get("/v1/nodes/node-a")
        assert node.status_code == 200 and node.json()["last_heartbeat"], node.text
        cordon = await http.post("/v1/nodes/node-a:cordon", json={"reason": "following the leader"})
        assert cordon.status_code == 200 and cordon.json()["cordoned"] is True, cordon.text
        uncordon = await http.post("/v1/nodes/node-a:uncordon")
        assert uncordon.status_code == 200 and uncordon.json()["cordoned"] is False, uncordon.text


async def test_node_calls_follow_the_leader_the_standby_names(etcd_settings: dict[str, str], key_prefix: str,
                                                             leader: Cluster) -> None:
    standby = await start_standby(leader)
    try:
        async def names_leader() -> bool:
            return await refusal(standby) == (grpc.StatusCode.UNAVAILABLE, leader.address)

        await eventually(names_leader, timeout=5, what="the standby to name the leader")
        async with running_gateway(etcd=etcd_settings, etcd_prefix=key_prefix.rstrip("/"),
                                   scheduler_address=f"127.0.0.1:{standby.grpc_port},{leader.address}") as gw:
            await node_calls_answer(gw)
    finally:
        await stop_standby(standby)


async def test_node_calls_find_the_leader_among_the_replicas_when_the_standby_names_nobody(
        etcd_settings: dict[str, str], etcd_options: EtcdOptions, key_prefix: str, leader: Cluster) -> None:
    store = FaultyStore(EtcdStore.from_options(etcd_options))
    store.fail_gets(leader.scheduler.keys.leader)  # it can never read who leads
    standby = await start_standby(leader, store)
    try:
        await eventually(lambda: truthy(store.failed_gets > 0), timeout=5, what="the standby's leader lookup to fail")
        assert await refusal(standby) == (grpc.StatusCode.UNAVAILABLE, "")
        async with running_gateway(etcd=etcd_settings, etcd_prefix=key_prefix.rstrip("/"),
                                   scheduler_address=f"127.0.0.1:{standby.grpc_port},{leader.address}") as gw:
            await node_calls_answer(gw)
    finally:
        await stop_standby(standby, store)


async def test_node_calls_reach_the_standby_once_it_has_taken_over(etcd_settings: dict[str, str], key_prefix: str,
                                                                  leader: Cluster) -> None:
    standby = await start_standby(leader)
    try:
        async with running_gateway(etcd=etcd_settings, etcd_prefix=key_prefix.rstrip("/"),
                                   scheduler_address=f"127.0.0.1:{standby.grpc_port},{leader.address}") as gw:
            await eventually(lambda: _answers(gw), timeout=5, what="node calls answered through the standby")
            await leader.stop_scheduler()  # resigns: the standby takes over at once
            await eventually(lambda: truthy(standby.leadership.is_leader), timeout=10, what="the standby to lead")
            # The leader the gateway had remembered is gone; the new one answers at the first try.
            async with gw.client(gw.admin_token) as http:
                listed = await http.get("/v1/nodes")
            assert listed.status_code == 200, listed.text
            assert [n["node_id"] for n in listed.json()["nodes"]] == ["node-a"]
    finally:
        await stop_standby(standby)


async def _answers(gw: RunningGateway) -> bool:
    async with gw.client(gw.admin_token) as http:
        try:
            return (await http.get("/v1/nodes")).status_code == 200
        except httpx.TransportError:
            return False
