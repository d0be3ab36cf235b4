"""A TCP and UDP proxy on loopback that can go silent: the test double of a cut cable or a powered-off host.

`cut()` stops forwarding in both directions without closing anything, so neither end gets a FIN or a reset:
only its own timeouts (HTTP/2 keepalive here) can tell it the other end is gone — which is what a dead host
looks like, unlike a killed process, whose kernel closes its sockets at once. `heal()` forwards again (bytes
held back meanwhile are dropped, as a real network would have). `close()` closes the listener and every
connection (a FIN to both ends).

UDP on the same port number is relayed too (the agents' liveness pulses go to the port their stream does):
each client address gets its own socket towards the target, and answers come back to that client. Silent,
datagrams are dropped both ways.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket

# Ports tried for one whose number is free over both TCP and UDP.
BIND_TRIES = 50


class BlackholeProxy:
    def __init__(self, target_host: str, target_port: int, *, listen_host: str = "127.0.0.1") -> None:
        self._target = (target_host, target_port)
        self._listen_host = listen_host
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.silent = False
        self.port = 0
        self._udp: socket.socket | None = None
        self._udp_up: dict[tuple[str, int], socket.socket] = {}

    @property
    def open_connections(self) -> int:
        """TCP connections through the proxy whose two directions are not both closed yet."""
        return (len(self._tasks) + 1) // 2

    @property
    def address(self) -> str:
        return f"{self._listen_host}:{self.port}"

    async def start(self) -> BlackholeProxy:
        # The same port number over TCP and UDP (pulses go to the stream's port): a free TCP port's number may
        # be taken over UDP (a swarm of thousands of agents holds as many UDP sockets), so try another then.
        for attempt in range(BIND_TRIES):
            self._server = await asyncio.start_server(self._accept, self._listen_host, 0)
            self.port = self._server.sockets[0].getsockname()[1]
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:
                udp.bind((self._listen_host, self.port))
                break
            except OSError as exc:
                udp.close()
                self._server.close()
                await self._server.wait_closed()
                if exc.errno != errno.EADDRINUSE or attempt == BIND_TRIES - 1:
                    raise
        udp.setblocking(False)
        self._udp = udp
        asyncio.get_running_loop().add_reader(udp.fileno(), self._udp_in)
        return self

    def _udp_in(self) -> None:
        """Client → target: each client address through its own upstream socket."""
        assert self._udp is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                data, addr = self._udp.recvfrom(65536)
            except OSError:  # nothing more to read now (or an ICMP error, reported once)
                return
            if self.silent:
                continue
            up = self._udp_up.get(addr)
            if up is None:
                up = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                up.setblocking(False)
                up.connect(self._target)
                self._udp_up[addr] = up
                loop.add_reader(up.fileno(), self._udp_back, up, addr)
            with contextlib.suppress(OSError):
                up.send(data)

    def _udp_back(self, up: socket.socket, addr: tuple[str, int]) -> None:
        """Target → client."""
        while True:
            try:
                data = up.recv(65536)
            except OSError:  # nothing more to read now (or an ICMP error, reported once)
                return
            if not self.silent and self._udp is not None:
                with contextlib.suppress(OSError):
                    self._udp.sendto(data, addr)

    def cut(self) -> None:
        self.silent = True

    def heal(self) -> None:
        self.silent = False

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        loop = asyncio.get_running_loop()
        for sock in [*self._udp_up.values(), *([self._udp] if self._udp is not None else [])]:
            loop.remove_reader(sock.fileno())
            sock.close()
        self._udp_up.clear()
        self._udp = None
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
