"""A TCP proxy on loopback that can go silent: the test double of a cut cable or a powered-off host.

`cut()` stops forwarding in both directions without closing anything, so neither end gets a FIN or a reset:
only its own timeouts (HTTP/2 keepalive here) can tell it the other end is gone — which is what a dead host
looks like, unlike a killed process, whose kernel closes its sockets at once. `heal()` forwards again (bytes
held back meanwhile are dropped, as a real network would have). `close()` closes the listener and every
connection (a FIN to both ends).
"""

from __future__ import annotations

import asyncio
import contextlib


class BlackholeProxy:
    def __init__(self, target_host: str, target_port: int, *, listen_host: str = "127.0.0.1") -> None:
        self._target = (target_host, target_port)
        self._listen_host = listen_host
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.silent = False
        self.port = 0

    @property
    def address(self) -> str:
        return f"{self._listen_host}:{self.port}"

    async def start(self) -> BlackholeProxy:
        self._server = await asyncio.start_server(self._accept, self._listen_host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def cut(self) -> None:
        self.silent = True

    def heal(self) -> None:
        self.silent = False

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for w in list(self._writers):
            w.close()
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.silent:  # a new connection to a dead host: never answered
            self._writers.add(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.close()
            return
        self._writers.update((writer, up_writer))
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pump(src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                if self.silent:
                    continue
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            if not self.silent:
                dst.close()
