"""The reconciler's AgentPort over gRPC: one channel per agent address, reused.

With mTLS each channel presents the scheduler's certificate and accepts only an agent whose certificate
names the node the call is meant for (`trainyard://node/<node_id>`): an address that now belongs to another
host, or a host answering for a node it is not, is refused at the handshake instead of being sent the
launch.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc.aio

from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard_core.audit import REQUEST_ID_HEADER, AuditSink, new_request_id
from trainyard_core.errors import FailedPrecondition
from trainyard_core.rpc.audit import record_call
from trainyard_core.rpc.channels import Channels
from trainyard_core.rpc.errors import from_rpc_error
from trainyard_core.rpc.liveness import LAUNCH_CHANNEL_OPTIONS, LAUNCH_IDLE_S
from trainyard_core.security import identity
from trainyard_core.security.identity import InvalidPrincipal, Principal
from trainyard_core.security.job_credentials import JobCredential
from trainyard_core.security.pki import CertFiles

from ..domain.models import Node
from ..launch import NodeLaunch
from .convert import launch_to_pb

# Plaintext channels check no principal; node ids the contract allows but no certificate can name (a
# trailing '-') still get one there.
_UNCHECKED = identity.node("plaintext")


LAUNCH = "/trainyard.agent.v1.AgentService/LaunchWorkers"
STOP = "/trainyard.agent.v1.AgentService/StopWorkers"
RENEW = "/trainyard.agent.v1.AgentService/RenewJobCredential"


class GrpcAgents:
    """`audit`: where the scheduler's side of each launch and stop is recorded (the agent keeps its own side in
    its state directory, out of the operators' reach through the gateway)."""

    def __init__(self, tls: CertFiles | None, call_timeout_s: float = 10.0, audit: AuditSink | None = None) -> None:
        # A connection per agent only while it is used: an idle one is closed (liveness.LAUNCH_IDLE_S).
        self._channels = Channels(tls, options=LAUNCH_CHANNEL_OPTIONS, idle_s=LAUNCH_IDLE_S)
        self._timeout = call_timeout_s
        self._audit = audit

    async def _record(self, method: str, request: object, node: Node, failure: BaseException | None,
                      request_id: str) -> None:
        await record_call(self._audit, principal=str(identity.SCHEDULER), service="scheduler", method=method,
                          request=request, callee=f"node/{node.node_id}", failure=failure, request_id=request_id)

    def _expected(self, node: Node) -> Principal:
        try:
            return identity.node(node.node_id)
        except InvalidPrincipal as exc:
            if not self._channels.secure:
                return _UNCHECKED
            raise FailedPrecondition(f"node {node.node_id!r} cannot be reached over mTLS: no certificate can "
                                     f"name it ({exc})") from exc

    @contextlib.asynccontextmanager
    async def _stub(self, node: Node) -> AsyncIterator[agent_pb2_grpc.AgentServiceStub]:
        """The agent's stub for one call; its channel is not closed as idle while the call runs."""
        async with self._channels.lease(node.agent_address, self._expected(node)) as channel:
            yield agent_pb2_grpc.AgentServiceStub(channel)

    async def launch(self, node: Node, launch: NodeLaunch, epoch: int) -> None:
        request = launch_to_pb(launch, epoch)
        # One request id for both sides: the agent's entry of this launch and the scheduler's.
        request_id = new_request_id()
        try:
            async with self._stub(node) as stub:
                await stub.LaunchWorkers(request, timeout=self._timeout, metadata=((REQUEST_ID_HEADER, request_id),))
        except grpc.aio.AioRpcError as exc:
            await self._record(LAUNCH, request, node, exc, request_id)
            raise from_rpc_error(exc, f"agent {node.node_id}") from exc
        await self._record(LAUNCH, request, node, None, request_id)

    async def stop(self, node: Node, job_id: str, attempt: int, grace_s: float, reason: str, epoch: int,
                   signal: str = "") -> None:
        request = agent_pb2.StopWorkersRequest(job_id=job_id, attempt=attempt, grace_period_ms=int(grace_s * 1000),
                                               reason=reason, leader_epoch=epoch, signal=signal)
        request_id = new_request_id()
        try:
            async with self._stub(node) as stub:
                await stub.StopWorkers(request, timeout=grace_s + self._timeout,
                                       metadata=((REQUEST_ID_HEADER, request_id),))
        except grpc.aio.AioRpcError as exc:
            await self._record(STOP, request, node, exc, request_id)
            raise from_rpc_error(exc, f"agent {node.node_id}") from exc
        await self._record(STOP, request, node, None, request_id)

    async def renew_credential(self, node: Node, credential: JobCredential, epoch: int) -> None:
        """Replace the checkpoint-store credential of the attempt's workers on `node` (credential_renewal.py).
        The audit records the job and attempt, never the credential."""
        grant = credential.grant
        request = agent_pb2.RenewJobCredentialRequest(
            job_id=grant.job_id, attempt=grant.attempt, leader_epoch=epoch,
            credential=agent_pb2.JobCredential(cert_chain=credential.cert_chain, key=credential.key,
                                               ca=credential.ca))
        request_id = new_request_id()
        try:
            async with self._stub(node) as stub:
                await stub.RenewJobCredential(request, timeout=self._timeout,
                                              metadata=((REQUEST_ID_HEADER, request_id),))
        except grpc.aio.AioRpcError as exc:
            await self._record(RENEW, request, node, exc, request_id)
            raise from_rpc_error(exc, f"agent {node.node_id}") from exc
        await self._record(RENEW, request, node, None, request_id)

    async def close(self) -> None:
        await self._channels.close()
