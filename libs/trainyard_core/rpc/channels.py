"""Client channels by address, reused, each verifying the principal it expects of its server.

With mTLS (`tls` given) a channel presents this service's certificate and accepts only a server whose
certificate names the expected principal (`secure_channel`). When the certificate is rotated on disk, the
next `get` opens a new channel with it; the old one is closed a grace period later, so calls in flight on
it finish. Without `tls` (insecure_plaintext) channels are plaintext and `expected` is not checked.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import grpc.aio

from ..security.identity import Principal
from ..security.pki import CertFiles
from ..security.tls import ClientTls
from .server import insecure_channel, secure_channel

RETIRE_AFTER_S = 60.0


# gRPC shares one connection (subchannel) and its reconnect backoff between channels to the same address with
# the same arguments. A pool with this option keeps its own: a long-lived stream that keeps reconnecting while
# its server restarts (the gateway's job view feed) then does not put the request path's connection into a
# backoff that fails the first requests after the server is back.
OWN_CONNECTIONS = (("grpc.use_local_subchannel_pool", 1),)


class Channels:
    """`options`: channel arguments added to every channel of this pool (e.g. OWN_CONNECTIONS)."""

    def __init__(self, tls: CertFiles | None, *, options: Sequence[tuple[str, Any]] = ()) -> None:
        self._options = tuple(options)
        self._tls = ClientTls(tls) if tls is not None else None
        self._open: dict[tuple[str, Principal], tuple[int, grpc.aio.Channel]] = {}
        self._retiring: dict[asyncio.Task[None], grpc.aio.Channel] = {}

    @property
    def secure(self) -> bool:
        return self._tls is not None

    def get(self, address: str, expected: Principal) -> grpc.aio.Channel:
        generation = self._tls.generation if self._tls is not None else 0
        key = (address, expected)
        found = self._open.get(key)
        if found is not None and found[0] == generation:
            return found[1]
        if found is not None:
            self._retire(found[1])
        channel = (secure_channel(address, self._tls, expected, self._options) if self._tls is not None
                   else insecure_channel(address, self._options))
        self._open[key] = (generation, channel)
        return channel

    def _retire(self, channel: grpc.aio.Channel) -> None:
        async def later() -> None:
            await asyncio.sleep(RETIRE_AFTER_S)
            await channel.close()
        task = asyncio.get_running_loop().create_task(later())
        self._retiring[task] = channel
        task.add_done_callback(lambda t: self._retiring.pop(t, None))

    async def close(self) -> None:
        for task, channel in list(self._retiring.items()):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await channel.close()
        for _, channel in self._open.values():
            await channel.close()
        self._open.clear()
