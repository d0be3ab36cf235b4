"""The gateway's listening socket lets asyncio turn on TCP_NODELAY for every connection.

Without it, each keep-alive HTTP request waited for the client's delayed ACK (~40 ms on Linux)."""

from __future__ import annotations

import asyncio
import socket

from trainyard_gateway.app import _listen


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
