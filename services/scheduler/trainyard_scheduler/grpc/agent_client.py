"""The reconciler's AgentPort over gRPC: one channel per agent address, reused."""

from __future__ import annotations

import grpc.aio

from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard_core.rpc.errors import from_rpc_error
from trainyard_core.rpc.server import insecure_channel

from ..domain.models import Node
from ..launch import NodeLaunch
from .convert import launch_to_pb


class GrpcAgents:
    def __init__(self, call_timeout_s: float = 10.0) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._timeout = call_timeout_s

    def _stub(self, address: str) -> agent_pb2_grpc.AgentServiceStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = insecure_channel(address)
        return agent_pb2_grpc.AgentServiceStub(channel)

    async def launch(self, node: Node, launch: NodeLaunch, epoch: int) -> None:
        try:
            await self._stub(node.agent_address).LaunchWorkers(launch_to_pb(launch, epoch), timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, f"agent {node.node_id}") from exc

    async def stop(self, node: Node, job_id: str, attempt: int, grace_s: float, reason: str, epoch: int,
                   signal: str = "") -> None:
        request = agent_pb2.StopWorkersRequest(job_id=job_id, attempt=attempt, grace_period_ms=int(grace_s * 1000),
                                               reason=reason, leader_epoch=epoch, signal=signal)
        try:
            await self._stub(node.agent_address).StopWorkers(request, timeout=grace_s + self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, f"agent {node.node_id}") from exc

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
