"""Client channels by address, reused, each verifying the principal it expects of its server.

With mTLS (`tls` given) a channel presents this service's certificate and accepts only a server whose
certificate names the expected principal (`secure_channel`). When the certificate is rotated on disk, the
next `get` opens a new channel with it; the old one is closed a grace period later, so calls in flight on
it finish. Without `tls` (insecure_plaintext) channels are plaintext and `expected` is not checked.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc.aio

from ..security.identity import Principal
from ..security.pki import CertFiles
from ..security.tls import ClientTls
from ..waits import cancel_and_wait
from .server import insecure_channel, secure_channel

RETIRE_AFTER_S = 60.0


# gRPC shares one connection (subchannel) and its reconnect backoff between channels to the same address with
# the same arguments. A pool with this option keeps its own: a long-lived stream that keeps reconnecting while
# its server restarts (the gateway's job view feed) then does not put the request path's connection into a
# backoff that fails the first requests after the server is back.
OWN_CONNECTIONS = (("grpc.use_local_subchannel_pool", 1),)


class Channels:
    """`options`: channel arguments added to every channel of this pool (e.g. OWN_CONNECTIONS). `idle_s`: a
    channel not handed out for this long is closed (its connection with it) and opened again by the next
    `get` (a channel in a `lease` is not closed). (gRPC's `grpc.client_idle_timeout_ms` is not enough:
    grpcio 1.85 drops an idle connection only the first time, and a channel that reconnected stays connected.)
    None: channels stay open."""

    def __init__(self, tls: CertFiles | None, *, options: Sequence[tuple[str, Any]] = (),
                 idle_s: float | None = None) -> None:
        self._options = tuple(options)
        self._tls = ClientTls(tls) if tls is not None else None
        self._open: dict[tuple[str, Principal], tuple[int, grpc.aio.Channel]] = {}
        self._retiring: dict[asyncio.Task[None], grpc.aio.Channel] = {}
        self._idle_s = idle_s
        self._used: dict[tuple[str, Principal], float] = {}
        self._reaper: asyncio.Task[None] | None = None
        self._busy: dict[tuple[str, Principal], int] = {}

    @property
    def secure(self) -> bool:
        return self._tls is not None

    def __len__(self) -> int:
        return len(self._open)

    def get(self, address: str, expected: Principal) -> grpc.aio.Channel:
        generation = self._tls.generation if self._tls is not None else 0
        key = (address, expected)
        if self._idle_s is not None:
            self._used[key] = asyncio.get_running_loop().time()
            if self._reaper is None:
                self._reaper = asyncio.get_running_loop().create_task(self._reap(self._idle_s))
        found = self._open.get(key)
        if found is not None and found[0] == generation:
            return found[1]
        if found is not None:
            self._retire(found[1])
        channel = (secure_channel(address, self._tls, expected, self._options) if self._tls is not None
                   else insecure_channel(address, self._options))
        self._open[key] = (generation, channel)
        return channel

    @contextlib.asynccontextmanager
    async def lease(self, address: str, expected: Principal) -> AsyncIterator[grpc.aio.Channel]:
        """`get` for one call: the channel is not closed as idle while the call runs, and its idle time counts
        from the call's end."""
        key = (address, expected)
        self._busy[key] = self._busy.get(key, 0) + 1
        try:
            yield self.get(address, expected)
        finally:
            left = self._busy[key] - 1
            if left:
                self._busy[key] = left
            else:
                del self._busy[key]
            if self._idle_s is not None:
                self._used[key] = asyncio.get_running_loop().time()

    async def _reap(self, idle_s: float) -> None:
        """Close the channels not handed out for `idle_s` and not in a lease, checking every quarter of it."""
        loop = asyncio.get_running_loop()
        while self._open:
            await asyncio.sleep(idle_s / 4)
            now = loop.time()
            for key in [k for k, used in self._used.items() if now - used >= idle_s and k not in self._busy]:
                del self._used[key]
                found = self._open.pop(key, None)
                if found is not None:
                    await found[1].close()
        self._reaper = None

    def _retire(self, channel: grpc.aio.Channel) -> None:
        async def later() -> None:
            await asyncio.sleep(RETIRE_AFTER_S)
            await channel.close()
        task = asyncio.get_running_loop().create_task(later())
        self._retiring[task] = channel
        task.add_done_callback(lambda t: self._retiring.pop(t, None))

    async def close(self) -> None:
        if self._reaper is not None:
            await cancel_and_wait(self._reaper)
            self._reaper = None
        for task, channel in list(self._retiring.items()):
            await cancel_and_wait(task)
            await channel.close()
        for _, channel in self._open.values():
            await channel.close()
        self._open.clear()
