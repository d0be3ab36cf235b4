"""A scheduler address that serves PolicyService (queues, quotas) next to JobService, for the gateway's and
the CLI's tests of those APIs.

It is the cluster's own scheduler when that serves PolicyService. Otherwise (while the scheduler process
does not register the service yet) it is a second gRPC server on a free port, built from the same real
servicers over the cluster scheduler's etcd store and key prefix, so jobs submitted through it are the
cluster's jobs and the queues and quotas it stores are the ones the cluster's scheduler reads.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import grpc.aio

from trainyard.scheduler.v1 import policy_pb2, policy_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from trainyard_core.rpc.server import start_grpc_server
from trainyard_scheduler.grpc.policy_servicer import PolicyServicer
from trainyard_scheduler.grpc.servicer import JobServicer
from trainyard_scheduler.state.policy_repository import PolicyRepository
from trainyard_scheduler.state.repository import Repository

from .support import HELPER_METADATA, Cluster


async def serves_policy(address: str) -> bool:
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            await policy_pb2_grpc.PolicyServiceStub(channel).ListQueues(
                policy_pb2.ListQueuesRequest(), metadata=HELPER_METADATA, timeout=5)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return False
            raise
    return True


@contextlib.asynccontextmanager
async def policy_endpoint(cluster: Cluster) -> AsyncIterator[str]:
    if await serves_policy(cluster.address):
        yield cluster.address
        return
    app = cluster.scheduler
    jobs = JobServicer(Repository(app.store, app.keys), app.clock, asyncio.Event())
    policy = PolicyServicer(PolicyRepository(app.store, app.keys))

    def register(server: grpc.aio.Server) -> None:
        scheduler_pb2_grpc.add_JobServiceServicer_to_server(jobs, server)
        policy_pb2_grpc.add_PolicyServiceServicer_to_server(policy, server)

    server = await start_grpc_server(
        host="127.0.0.1", port=0, register=register,
        service_names=[scheduler_pb2.DESCRIPTOR.services_by_name["JobService"].full_name,
                       policy_pb2.DESCRIPTOR.services_by_name["PolicyService"].full_name])
    try:
        yield f"127.0.0.1:{server.port}"
    finally:
        await server.stop(grace=0.5)
