"""The reconciler's AgentPort over gRPC: one channel per agent address, reused.

With mTLS each channel presents the scheduler's certificate and accepts only an agent whose certificate
names the node the call is meant for (`trainyard://node/<node_id>`): an address that now belongs to another
host, or a host answering for a node it is not, is refused at the handshake instead of being sent the
launch.
"""

from __future__ import annotations

import grpc.aio

from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard_core.errors import FailedPrecondition
from trainyard_core.rpc.channels import Channels
from trainyard_core.rpc.errors import from_rpc_error
from trainyard_core.security import identity
from trainyard_core.security.identity import InvalidPrincipal, Principal
from trainyard_core.security.pki import CertFiles

from ..domain.models import Node
from ..launch import NodeLaunch
from .convert import launch_to_pb

# Plaintext channels check no principal; node ids the contract allows but no certificate can name (a
# trailing '-') still get one there.
_UNCHECKED = identity.node("plaintext")


class GrpcAgents:
    def __init__(self, tls: CertFiles | None, call_timeout_s: float = 10.0) -> None:
        self._channels = Channels(tls)
        self._timeout = call_timeout_s

    def _expected(self, node: Node) -> Principal:
        try:
            return identity.node(node.node_id)
        except InvalidPrincipal as exc:
            if not self._channels.secure:
                return _UNCHECKED
            raise FailedPrecondition(f"node {node.node_id!r} cannot be reached over mTLS: no certificate can "
                                     f"name it ({exc})") from exc

    def _stub(self, node: Node) -> agent_pb2_grpc.AgentServiceStub:
        return agent_pb2_grpc.AgentServiceStub(self._channels.get(node.agent_address, self._expected(node)))

    async def launch(self, node: Node, launch: NodeLaunch, epoch: int) -> None:
        try:
            await self._stub(node).LaunchWorkers(launch_to_pb(launch, epoch), timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, f"agent {node.node_id}") from exc

    async def stop(self, node: Node, job_id: str, attempt: int, grace_s: float, reason: str, epoch: int,
                   signal: str = "") -> None:
        request = agent_pb2.StopWorkersRequest(job_id=job_id, attempt=attempt, grace_period_ms=int(grace_s * 1000),
                                               reason=reason, leader_epoch=epoch, signal=signal)
        try:
            await self._stub(node).StopWorkers(request, timeout=grace_s + self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, f"agent {node.node_id}") from exc

    async def close(self) -> None:
        await self._channels.close()
