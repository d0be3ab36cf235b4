"""The etcd store's connection: one member at a time, moved to the next on a failure, renewed when its TLS
files are rotated, with etcd's refusals turned into the project's errors (etcd.py's docstring says why each
is what it is).

`generation` grows each time the connection is replaced (a failover, a rotation): a call notes it when it
starts, and its failure moves to the next member only if no other call has moved since.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import aetcd
import aetcd.exceptions
import grpc
import grpc.aio

from ..errors import StoreOutOfSpace, Unavailable
from .etcd_client import (
    Client,
    LoginRefused,
    denied,
    is_login_refused,
    is_no_space,
    is_permission_denied,
    is_stale_token,
    out_of_space,
    tls_problem,
    tls_signature,
)
from .etcd_options import EtcdOptions

log = logging.getLogger("trainyard_core.store.etcd")
T = TypeVar("T")
# How often, at most, the connection looks at its TLS files for a rotation (at its next call).
TLS_CHECK_EVERY_S = 1.0
_RPC_ERRORS = (grpc.aio.AioRpcError, aetcd.exceptions.ClientError)


def unavailable(exc: BaseException, endpoint: str) -> Unavailable:
    # gRPC's own str() is a multi-line dump; its code and details are what a reader needs.
    what = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else \
        f"{type(exc).__name__}: {exc}"
    return Unavailable(f"etcd at {endpoint} is unavailable: {what}")


class EtcdConnection:
    def __init__(self, endpoints: Sequence[tuple[str, int]], options: EtcdOptions, *, timeout: float) -> None:
        self._endpoints = list(endpoints)
        self._options = options
        self._timeout = timeout
        self._current = 0
        self._client: Client | None = None
        self.generation = 0
        self._lock = asyncio.Lock()
        self._closing: set[asyncio.Task[None]] = set()
        self._retired: set[aetcd.Client] = set()
        self.logins = 0  # logins of every client made
        # The client's TLS files as last connected with; looked at once a second at most (see _rotated).
        self._tls_seen = tls_signature(options)
        self._tls_checked = time.monotonic()
        self._tls_broken: tuple[tuple[int, int, int], ...] | None = None
        self.tls_reloads = 0

    @property
    def endpoints(self) -> list[tuple[str, int]]:
        return list(self._endpoints)

    @property
    def current(self) -> int:
        """The index in `endpoints` of the member calls go to now."""
        return self._current

    @property
    def endpoint(self) -> str:
        host, port = self._endpoints[self._current]
        return f"{host}:{port}"

    @property
    def members(self) -> int:
        return len(self._endpoints)

    def _rotated(self) -> bool:
        """Whether the TLS files changed on disk into a usable set since the client connected (a broken set,
        mid-rotation, is logged once and the current connection kept)."""
        now = time.monotonic()
        if self._tls_seen is None or now - self._tls_checked < TLS_CHECK_EVERY_S:
            return False
        self._tls_checked = now
        seen = tls_signature(self._options)
        if seen is None or seen == self._tls_seen or seen == self._tls_broken:
            return False
        problem = tls_problem(self._options)
        if problem is not None:
            self._tls_broken = seen
            log.warning("rotated etcd TLS files are not usable yet; keeping the current connection",
                        extra={"endpoint": self.endpoint, "reason": problem})
            return False
        self._tls_seen, self._tls_broken = seen, None
        return True

    async def client(self) -> Client:
        if self._client is not None and self._rotated():
            # A rotated client certificate (or CA): the next call connects with it; calls and watches on the
            # old connection get their deadline, then it is closed (a watch then resumes on the new one).
            old, self._client = self._client, None
            self.generation += 1
            self.tls_reloads += 1
            log.info("etcd TLS files reloaded", extra={"endpoint": self.endpoint,
                                                       "cert_file": str(self._options.cert_file)})
            self._retire(old)
        if self._client is None:
            async with self._lock:
                if self._client is None:
                    host, port = self._endpoints[self._current]
                    # The files this connection reads (Client.connect reads them).
                    self._tls_seen = tls_signature(self._options) or self._tls_seen
                    # Floats: int() made a 0.5 s deadline none at all, and 1.5 s one second.
                    client = Client(host, port, self._options, timeout=self._timeout)
                    try:
                        await client.connect()
                    except grpc.aio.AioRpcError as exc:
                        with contextlib.suppress(Exception):
                            await client.close()
                        if is_login_refused(exc):
                            raise LoginRefused(f"etcd at {host}:{port} refused the login of etcd_user "
                                               f"{self._options.user!r}: {exc.details()}") from exc
                        raise
                    self.logins += client.logins
                    self._client = client
        return self._client

    async def renew(self, client: Client, stale: Any) -> None:
        before = client.logins
        try:
            await client.renew_token(stale)
        except grpc.aio.AioRpcError as exc:
            if is_login_refused(exc):
                raise LoginRefused(f"etcd at {self.endpoint} refused the login of etcd_user "
                                   f"{self._options.user!r}: {exc.details()}") from exc
            raise
        finally:
            self.logins += client.logins - before

    async def call(self, what: str, key: str, call: Callable[[Client], Awaitable[T]]) -> T:
        """`call` on the current client. A token etcd no longer knows is renewed and the call made once more
        (etcd refused it before applying anything); a refusal of the user's role is PermissionDenied."""
        client = await self.client()
        stale = client.metadata
        try:
            return await call(client)
        except _RPC_ERRORS as exc:
            if is_permission_denied(exc):
                raise denied(what, key, self._options, exc) from exc
            if is_no_space(exc):
                raise self._out_of_space(what, key, exc) from exc
            if not (client.uses_token and is_stale_token(exc)):
                raise
        await self.renew(client, stale)
        try:
            return await call(client)
        except _RPC_ERRORS as exc:
            if is_permission_denied(exc):
                raise denied(what, key, self._options, exc) from exc
            if is_no_space(exc):
                raise self._out_of_space(what, key, exc) from exc
            if is_stale_token(exc):
                raise Unavailable(f"etcd at {self.endpoint} refused a token it had just issued: {exc}") from exc
            raise

    def _out_of_space(self, what: str, key: str, exc: BaseException) -> StoreOutOfSpace:
        """A NOSPACE refusal: definite (nothing applied), never a failover (every member shares the alarm),
        logged here once for each refused write."""
        err = out_of_space(what, key, self.endpoint, exc)
        log.error("etcd is out of space: a write was refused", extra={
            "endpoint": self.endpoint, "write": what, "key": key, "alarm": "NOSPACE"})
        return err

    async def fail(self, exc: BaseException, generation: int) -> Unavailable:
        """`exc` ended a call that started on connection `generation`: move to the next endpoint, unless
        another failed call already has."""
        if generation != self.generation:
            return unavailable(exc, "an endpoint since left")
        err = unavailable(exc, self.endpoint)
        self.generation += 1
        client, self._client = self._client, None
        self._current = (self._current + 1) % len(self._endpoints)
        log.info("etcd: moving to the next endpoint", extra={"endpoint": self.endpoint, "reason": str(err)})
        if client is not None:
            # Closing may wait on aetcd's watch stream of a dead member; never let the failing call (and
            # its caller's deadline) wait for that.
            self._retire(client)
        return err

    def _retire(self, client: aetcd.Client) -> None:
        self._retired.add(client)
        task = asyncio.create_task(self._close_quietly(client))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _close_quietly(self, client: aetcd.Client) -> None:
        # Calls still in flight on the old channel get their own deadline first: closing cancels them.
        await asyncio.sleep(self._timeout + 1)
        self._retired.discard(client)
        try:
            await asyncio.wait_for(client.close(), 2.0)
        except Exception:  # TimeoutError included; a broken channel may fail to close; nothing to do
            log.debug("closing etcd client failed", exc_info=True)

    async def close(self) -> None:
        client, self._client = self._client, None
        for task in list(self._closing):
            task.cancel()
        retired, self._retired = list(self._retired), set()
        for old in retired:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(old.close(), 2.0)
        if client is not None:
            await client.close()
