"""The gateway's HTTP connections: asyncio turns on TCP_NODELAY for every one (without it, each keep-alive request
waited for the client's delayed ACK, ~40 ms on Linux), and an idle one is kept `http_keep_alive_s`."""

from __future__ import annotations

import asyncio
import socket

from tests.gateway.support import running_gateway
from trainyard_core.testing.etcd import free_port
from trainyard_gateway.app import _listen
from trainyard_gateway.settings import GatewaySettings


async def test_accepted_connections_have_tcp_nodelay() -> None:
    sock = _listen("127.0.0.1", 0)
    assert sock.proto == socket.IPPROTO_TCP
    seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = writer.get_extra_info("socket")
        seen.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(on_connect, sock=sock)
    _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
    assert await asyncio.wait_for(seen, 5) != 0
    writer.close()
    server.close()
    await server.wait_closed()


async def _get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    """One GET /healthz on an open connection; its status line ('' when the server had closed it)."""
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n")
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) if not reader.at_eof() else b""
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    await reader.readexactly(length)
    return head.split(b"\r\n", 1)[0]


async def test_an_idle_connection_is_kept_for_http_keep_alive_s_then_closed(etcd_settings: dict[str, str],
                                                                            key_prefix: str) -> None:
    """The setting reaches the HTTP server: a connection idle for less than it is reused, one idle for longer is
    closed by the server. (Its default, 75 s, outlasts clients' idle pools: httpx's 5 s raced uvicorn's 5 s,
    and a request sent as the server closed the connection failed with a dropped connection.)"""
    assert GatewaySettings.model_fields["http_keep_alive_s"].default > 60  # a proxy's 60 s pool closes first
    async with running_gateway(etcd=etcd_settings, etcd_prefix=key_prefix.rstrip("/"),
                               scheduler_address=f"127.0.0.1:{free_port()}", http_keep_alive_s=2) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.app.http_port)
        try:
            # No scheduler behind it: /healthz answers 503, which is an answer on this connection all the same.
            assert await _get(reader, writer) == b"HTTP/1.1 503 Service Unavailable"
            await asyncio.sleep(1.0)
            assert await _get(reader, writer) == b"HTTP/1.1 503 Service Unavailable", "idle 1 s of 2: still open"
            await asyncio.sleep(3.0)
            assert await asyncio.wait_for(reader.read(), 5) == b"", "idle 3 s of 2: the server closed it"
        finally:
            writer.close()
