"""The floor under the scheduler's liveness cost, measured in the fleet benchmark's own run: a bare gRPC server
with the scheduler's transport — the shared bootstrap (`start_grpc_server`, mTLS) with the scheduler's keepalive
options (`trainyard_core.rpc.liveness.SERVER_OPTIONS`) and the scheduler's own pulse endpoint and sessions
(`trainyard_scheduler.pulses`) — holding one idle Heartbeat stream per connection from clients with the agent's
own channel options (`trainyard_agent.app.scheduler_channel`), each presenting its node certificate and sending
liveness pulses with the agent's own `Pulser`. No message moves on a stream after its first beat: what the
server process spends is what keeping nodes proved alive costs (pulses in and acknowledgements out, HTTP/2
pings at the transport's rates, TLS, gRPC's threads), per connection-second.

The server and the clients run in child processes of their own (the server's CPU is read from /proc).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_agent.app import scheduler_channel
from trainyard_agent.pulse import Pulser
from trainyard_core.clock import SystemClock
from trainyard_core.rpc import liveness, pulse
from trainyard_core.rpc.server import start_grpc_server
from trainyard_core.security import identity, pki
from trainyard_core.security.tls import ClientTls
from trainyard_scheduler.liveness import NodeLiveness
from trainyard_scheduler.pulses import PulseSessions, start_endpoint

from ._swarm import cpu_s

SERVICE = scheduler_pb2.DESCRIPTOR.services_by_name["NodeService"].full_name


def _echo(sessions: PulseSessions) -> Callable[..., AsyncIterator[scheduler_pb2.HeartbeatResponse]]:
    async def heartbeat(request_iterator: AsyncIterator[scheduler_pb2.HeartbeatRequest],
                        context: grpc.aio.ServicerContext) -> AsyncIterator[scheduler_pb2.HeartbeatResponse]:
        """NodeService.Heartbeat that answers every beat, opens a pulse session with the first, and does
        nothing else: the stream stays open, idle."""
        session = 0
        try:
            async for req in request_iterator:
                answer = scheduler_pb2.HeartbeatResponse(ack_seq=req.seq)
                if not session and req.pulses:
                    session, answer.pulse_key = sessions.open(req.node_id)
                    answer.pulse_session = session
                    answer.pulse_interval_ms = round(pulse.PULSE_INTERVAL_S * 1000)
                yield answer
        finally:
            sessions.close(session)
    return heartbeat


def _register(sessions: PulseSessions) -> Callable[[grpc.aio.Server], None]:
    def register(server: grpc.aio.Server) -> None:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
            "Heartbeat": grpc.stream_stream_rpc_method_handler(
                _echo(sessions), request_deserializer=scheduler_pb2.HeartbeatRequest.FromString,
                response_serializer=scheduler_pb2.HeartbeatResponse.SerializeToString)}),))
    return register


def _to_log(path: str) -> None:
    """This process's stderr (gRPC's own lines: a GOAWAY per connection when the server stops) to `path`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)


def _serve(conn: Connection, pki_dir: str, log_path: str) -> None:
    """The bare server: sends its port, serves until told to stop (or the parent goes away)."""
    _to_log(log_path)

    async def main() -> None:
        sessions = PulseSessions(NodeLiveness(SystemClock(), 2.0))
        server = await start_grpc_server(
            host="127.0.0.1", port=0, tls=pki.files_for(Path(pki_dir), identity.SCHEDULER), service_names=[SERVICE],
            options=liveness.SERVER_OPTIONS, register=_register(sessions))
        endpoint = await start_endpoint("127.0.0.1", server.port, sessions)
        conn.send(server.port)
        await asyncio.to_thread(conn.recv)
        endpoint.close()
        await server.stop(grace=0)

    with contextlib.suppress(EOFError, OSError):
        asyncio.run(main())


def _connect(conn: Connection, pki_dir: str, address: str, node_ids: Sequence[str], log_path: str) -> None:
    """The clients: one channel and one stream per node id; says "open" once every stream was answered, then
    holds them until told to stop (or the parent goes away)."""
    _to_log(log_path)

    async def main() -> None:
        stop = asyncio.Event()
        channels = []
        pulsers = []
        try:
            for node_id in node_ids:
                tls = ClientTls(pki.files_for(Path(pki_dir), identity.node(node_id)))
                channel = scheduler_channel(address, tls)().channel
                channels.append(channel)
                call = scheduler_pb2_grpc.NodeServiceStub(channel).Heartbeat(_one_beat(node_id, stop))
                answer = await call.read()  # the stream is open and answered
                assert isinstance(answer, scheduler_pb2.HeartbeatResponse) and answer.pulse_session
                pulser = Pulser.for_session(address, answer, SystemClock())
                await pulser.start()
                pulsers.append(pulser)
            conn.send("open")
            await asyncio.to_thread(conn.recv)
        finally:
            stop.set()
            for p in pulsers:
                await p.stop()
            for channel in channels:
                await channel.close()

    with contextlib.suppress(EOFError, OSError):
        asyncio.run(main())


async def _one_beat(node_id: str, stop: asyncio.Event) -> AsyncIterator[scheduler_pb2.HeartbeatRequest]:
    yield scheduler_pb2.HeartbeatRequest(node_id=node_id, seq=1, pulses=True)
    await stop.wait()


class _Child:
    def __init__(self, name: str, target: Callable[..., None], *args: object) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), name=name, daemon=True)
        self.proc.start()
        child.close()

    async def recv(self, timeout: float) -> Any:
        if not await asyncio.to_thread(self.conn.poll, timeout):
            raise RuntimeError(f"{self.proc.name} did not answer within {timeout:g}s (exit code {self.proc.exitcode})")
        return self.conn.recv()

    async def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send("stop")
        await asyncio.to_thread(self.proc.join, 10)
        if self.proc.is_alive():
            self.proc.kill()
        self.conn.close()


async def floor_us_per_conn_s(pki_dir: Path, node_ids: Sequence[str], window_s: float, log_dir: Path) -> float:
    """CPU of the bare server per connection-second over `window_s`, one connection per node id (certificates
    already issued under `pki_dir`); both processes log to `log_dir`."""
    server = _Child("keepalive-server", _serve, str(pki_dir), str(log_dir / "keepalive-server.log"))
    clients: _Child | None = None
    try:
        address = f"127.0.0.1:{await server.recv(60)}"
        clients = _Child("keepalive-clients", _connect, str(pki_dir), address, list(node_ids),
                         str(log_dir / "keepalive-clients.log"))
        await clients.recv(60 + len(node_ids) / 10)
        assert server.proc.pid is not None
        before, began = cpu_s(server.proc.pid), time.monotonic()
        await asyncio.sleep(window_s)
        spent, took = cpu_s(server.proc.pid) - before, time.monotonic() - began
        return spent / (len(node_ids) * took) * 1e6
    finally:
        if clients is not None:
            await clients.stop()  # before the server, so it has no connection left to end
        await server.stop()
