"""`Channels(idle_s=...)`: a pool that closes the channels (and their connections) nobody used for a while,
and reopens them on the next call — how the scheduler holds no connection per idle agent. Against a real
gRPC server, through a proxy that counts the open connections."""

from __future__ import annotations

import asyncio

import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from trainyard_core.rpc.channels import Channels
from trainyard_core.security import identity
from trainyard_core.testing.blackhole import BlackholeProxy
from trainyard_core.testing.wait import eventually

IDLE_S = 0.8


async def test_an_idle_channel_is_closed_reopened_by_the_next_call_and_never_closed_mid_call() -> None:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    proxy = await BlackholeProxy("127.0.0.1", port).start()
    pool = Channels(None, idle_s=IDLE_S)
    who = identity.node("node-1")

    async def check() -> None:
        async with pool.lease(proxy.address, who) as channel:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)

    async def closed() -> bool:
        return len(pool) == 0 and proxy.open_connections == 0

    try:
        # Twice: gRPC's own idle timeout drops a connection only the first time; the pool's does it every time.
        for _ in range(2):
            await check()
            assert len(pool) == 1 and proxy.open_connections == 1
            await eventually(closed, timeout=IDLE_S * 4 + 2, what="the idle channel and its connection to close")

        # A lease held past the idle time (a long call) keeps its channel.
        async with pool.lease(proxy.address, who) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            await asyncio.sleep(IDLE_S * 2.5)
            assert len(pool) == 1
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        await eventually(closed, timeout=IDLE_S * 4 + 2, what="the channel to close once the lease ended")
    finally:
        await pool.close()
        await proxy.close()
        await server.stop(None)
