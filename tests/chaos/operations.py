"""What an operator does to a cluster during and after the chaos: mark repaired GPUs healthy, uncordon
nodes, look at which nodes are ready.

The gateway is the operator's way in and is tried first. Where it fails, the same operation goes to the
service that owns it (the agent's SetGpuHealth, the leading scheduler's CordonNode and ListNodes, over
gRPC), and the gateway's failure is kept as a finding for the report: the queue must drain whatever the
gateway does, and the gateway's failure must not go unnoticed either.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from dataclasses import dataclass, field

import grpc
import grpc.aio
import httpx

from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_cli.local import LocalCluster
from trainyard_core.security import identity
from trainyard_core.security.identity import Principal
from trainyard_core.store.etcd import EtcdStore
from trainyard_scheduler.state.keys import Keys

log = logging.getLogger(__name__)

REASON = "chaos: repaired"


@dataclass(frozen=True)
class NodeView:
    node_id: str
    ready: bool
    cordoned: bool
    unhealthy: tuple[int, ...]


@dataclass
class Operator:
    cluster: LocalCluster
    http: httpx.AsyncClient
    store: EtcdStore
    keys: Keys = field(default_factory=Keys)
    # What went wrong through the gateway (kind of call and answer → how often).
    findings: Counter[str] = field(default_factory=Counter)
    _channels: dict[str, grpc.aio.Channel] = field(default_factory=dict)

    def _channel(self, address: str, expected: Principal) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = self.cluster.channel(address, expected)
        return self._channels[address]

    async def close(self) -> None:
        for ch in self._channels.values():
            with contextlib.suppress(Exception):
                await ch.close()

    async def leader(self) -> str:
        kv = await self.store.get(self.keys.leader)
        return kv.value.decode() if kv else ""

    def _finding(self, what: str, r: httpx.Response) -> None:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:200]
        # Replica addresses vary from run to run; the kind of failure is what matters.
        self.findings[f"{what}: HTTP {r.status_code}: {message.split(':')[0]}"] += 1

    async def set_healthy(self, node: str, gpu: int) -> bool:
        with contextlib.suppress(httpx.TransportError):
            r = await self.http.post(f"/v1/nodes/{node}/gpus/{gpu}:set-health",
                                     json={"healthy": True, "reason": REASON})
            if r.status_code == 200:
                return True
            # Not a finding: the gateway relays this to the node's agent, which may be down right now.
        port = self.cluster.procs[node].ports.get("grpc_port")
        if not port:
            return False
        try:
            channel = self._channel(f"{self.cluster.address_of(node)}:{port}", identity.node(node))
            await agent_pb2_grpc.AgentServiceStub(channel).SetGpuHealth(
                agent_pb2.SetGpuHealthRequest(gpu_index=gpu, healthy=True, operator="chaos", reason=REASON), timeout=5)
            return True
        except grpc.aio.AioRpcError:
            return False

    async def uncordon(self, node: str) -> bool:
        with contextlib.suppress(httpx.TransportError):
            r = await self.http.post(f"/v1/nodes/{node}:uncordon")
            if r.status_code == 200:
                return True
            self._finding("gateway uncordon", r)
        leader = await self.leader()
        if not leader:
            return False
        try:
            await scheduler_pb2_grpc.NodeServiceStub(self._channel(leader, identity.SCHEDULER)).CordonNode(
                scheduler_pb2.CordonNodeRequest(node_id=node, cordoned=False), timeout=5)
            return True
        except grpc.aio.AioRpcError:
            return False

    async def repair(self, node: str, gpu: int) -> bool:
        """After a GPU fault is fixed: the GPU healthy again, its node back in placement."""
        if not await self.set_healthy(node, gpu):
            return False
        view = {n.node_id: n for n in await self.nodes()}.get(node)
        return view is None or not view.cordoned or await self.uncordon(node)

    async def nodes(self) -> list[NodeView]:
        """The nodes as the leading scheduler sees them (the one whose liveness view counts); [] when there
        is no leader to ask. The gateway's answer is compared with it and a disagreement is a finding."""
        leader = await self.leader()
        if not leader:
            return []
        try:
            resp = await scheduler_pb2_grpc.NodeServiceStub(self._channel(leader, identity.SCHEDULER)).ListNodes(
                scheduler_pb2.ListNodesRequest(), timeout=5)
        except grpc.aio.AioRpcError:
            return []
        views = [NodeView(n.node_id, n.state in (types_pb2.NODE_STATE_READY, types_pb2.NODE_STATE_CORDONED),
                          n.cordoned, tuple(g.index for g in n.gpus if g.health == types_pb2.GPU_HEALTH_UNHEALTHY))
                 for n in resp.nodes]
        with contextlib.suppress(httpx.TransportError, ValueError, KeyError):
            r = await self.http.get("/v1/nodes")
            if r.status_code == 200:
                gateway = {n["node_id"]: n["state"] in ("ready", "cordoned") for n in r.json()["nodes"]}
                wrong = sorted(v.node_id for v in views if gateway.get(v.node_id) != v.ready)
                if wrong:
                    self.findings["gateway GET /v1/nodes: readiness differs from the leader's view"] += 1
        return views
