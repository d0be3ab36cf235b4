"""The etcd implementation of the store (etcd v3 through the `aetcd` asyncio client).

Several endpoints may be given (a 3-member cluster); on a connection failure the store moves to the next
endpoint for the following calls. Writes are not retried here: their outcome is unknown after a failure,
and callers re-read and retry through their own compare-and-swap loops.

Every call notes the connection generation it started on, and a failure moves to the next endpoint only if
no other call has moved since: when a member dies, all the calls in flight on it fail together, and each of
them stepping on would skip the healthy members (with three endpoints, three failures land back on the dead
one), costing the next call another failure, or a whole timeout where the member hangs.

TLS and etcd's own auth come from `EtcdOptions` (etcd_client.py: a token etcd no longer knows is renewed
and the call made once more; a refusal of the user's role is PermissionDenied, never a failover).
`etcd_check.check_access` is the start-up check of a service's etcd settings. The connection itself (the
member, failover, token renewal, TLS rotation) is `etcd_connection.EtcdConnection`. The client's TLS files are
looked at (at most once a second, at a call): when they were rotated on disk into a usable set, the next call
connects with them and the old connection is closed after its calls' deadline, with no restart.

A database at its space quota (etcd's NOSPACE alarm) refuses every write before applying it: that is
StoreOutOfSpace, whose outcome is known (not applied), logged once per refused write, and not a failover.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import aetcd
import aetcd.exceptions
import grpc
from aetcd import rpc

from ..errors import FailedPrecondition, InvalidArgument, Unavailable
from .api import Compare, KeyValue, Op, Put, RangeResult, TxnResult, WatchCompacted, WatchEvent, prefix_end
from .etcd_client import (
    WatchRefused,
    denied,
    is_stale_token,
    watch_responses,
)
from .etcd_connection import EtcdConnection
from .etcd_options import EtcdOptions
from .lease_thread import ThreadLeaseKeeper

log = logging.getLogger(__name__)
T = TypeVar("T")


_TARGETS = {"version": rpc.Compare.VERSION, "mod": rpc.Compare.MOD, "create": rpc.Compare.CREATE,
            "value": rpc.Compare.VALUE}
_OPS = {"==": rpc.Compare.EQUAL, "!=": rpc.Compare.NOT_EQUAL, "<": rpc.Compare.LESS,
        ">": rpc.Compare.GREATER}


def parse_endpoints(spec: str) -> list[tuple[str, int]]:
    """'127.0.0.1:2379,127.0.0.2:2379' (an optional http:// or https:// is accepted) → [(host, port), ...]."""
    out = []
    for raw in spec.split(","):
        item = raw.strip().removeprefix("http://").removeprefix("https://")
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise InvalidArgument(f"etcd endpoint {raw!r} must look like host:port")
        out.append((host, int(port)))
    if not out:
        raise InvalidArgument("no etcd endpoint given (expected host:port[,host:port...])")
    return out


def _kv(raw: rpc.KeyValue) -> KeyValue:
    return KeyValue(key=raw.key.decode(), value=raw.value, create_revision=raw.create_revision,
                    mod_revision=raw.mod_revision, version=raw.version, lease=raw.lease)


_CONNECTION_ERRORS = (aetcd.exceptions.ConnectionFailedError, aetcd.exceptions.ConnectionTimeoutError,
                      aetcd.exceptions.InternalError, grpc.aio.AioRpcError, OSError, asyncio.TimeoutError)


# The request is filled in place (`.add()` on its repeated fields): a gang's transaction carries one
# compare and one write per node, and building each message separately cost the leader about twice
# as much CPU per operation (measured with the scheduler benchmark's commit arm).
def _add_op(ops: Any, op: Op) -> None:
    if isinstance(op, Put):
        put = ops.add().request_put
        put.key = op.key.encode()
        put.value = op.value
        if op.lease:
            put.lease = op.lease
        return
    delete = ops.add().request_delete_range
    delete.key = op.key.encode()
    if op.prefix:
        delete.range_end = prefix_end(op.key).encode(errors="surrogateescape")


def _add_compare(compares: Any, c: Compare) -> None:
    msg = compares.add()
    msg.key = c.key.encode()
    msg.target = _TARGETS[c.target]
    msg.result = _OPS[c.op]
    if c.target == "value":
        msg.value = c.value if isinstance(c.value, bytes) else str(c.value).encode()
    elif c.target == "version":
        msg.version = int(c.value)
    elif c.target == "mod":
        msg.mod_revision = int(c.value)
    else:
        msg.create_revision = int(c.value)


def _txn_request(compares: Sequence[Compare], success: Sequence[Op],
                 failure: Sequence[Op] = ()) -> rpc.TxnRequest:
    request = rpc.TxnRequest()
    for c in compares:
        _add_compare(request.compare, c)
    for o in success:
        _add_op(request.success, o)
    for o in failure:
        _add_op(request.failure, o)
    return request


def _first_key(*groups: Sequence[Op | Compare]) -> str:
    """The key a refused transaction is reported by (its first write's)."""
    for group in groups:
        if group:
            return group[0].key
    return "(empty transaction)"


def _consume(task: asyncio.Future[Any]) -> None:
    """Retrieve an abandoned call's outcome so asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()



class EtcdStore:
    def __init__(self, endpoints: str | Sequence[tuple[str, int]], *, timeout: float = 5.0,
                 options: EtcdOptions | None = None) -> None:
        parsed = parse_endpoints(endpoints) if isinstance(endpoints, str) else list(endpoints)
        spec = endpoints if isinstance(endpoints, str) else ",".join(f"{h}:{p}" for h, p in parsed)
        self._options = options or EtcdOptions(endpoints=spec)
        self._timeout = timeout
        self._conn = EtcdConnection(parsed, self._options, timeout=timeout)

    @classmethod
    def from_options(cls, options: EtcdOptions, *, timeout: float = 5.0) -> EtcdStore:
        """The store for a service's etcd settings (`EtcdSettings.etcd_options()`)."""
        return cls(options.endpoints, timeout=timeout, options=options)

    @property
    def options(self) -> EtcdOptions:
        return self._options

    @property
    def endpoint(self) -> str:
        return self._conn.endpoint

    def lease_keeper(self, lease_id: int, ttl_s: float, *, loop_alive: Callable[[], float],
                     on_lost: Callable[[str], None]) -> ThreadLeaseKeeper:
        """A thread that renews `lease_id` over its own connection (lease_thread.py), starting with the member
        this store uses now; not started."""
        endpoints = self._conn.endpoints
        first = self._conn.current
        return ThreadLeaseKeeper(endpoints=endpoints, options=self._options, lease_id=lease_id, ttl_s=ttl_s,
                                 loop_alive=loop_alive, on_lost=on_lost, first=first)

    @property
    def logins(self) -> int:
        """Logins of every client this store made (tests read it)."""
        return self._conn.logins

    @property
    def tls_reloads(self) -> int:
        """Connections made anew because the TLS files were rotated (tests read it)."""
        return self._conn.tls_reloads

    async def _read_range(self, request: rpc.RangeRequest) -> rpc.RangeResponse:
        # Reads are safe to retry on the next endpoint.
        last: BaseException | None = None
        for _ in range(self._conn.members):
            generation = self._conn.generation
            try:
                return await self._conn.call("a read", request.key.decode(errors="replace"), lambda client:
                                        client.kvstub.Range(request, timeout=self._timeout, metadata=client.metadata))
            except _CONNECTION_ERRORS as exc:
                last = await self._conn.fail(exc, generation)
        assert last is not None
        raise last

    async def _get_impl(self, key: str) -> KeyValue | None:
        resp = await self._read_range(rpc.RangeRequest(key=key.encode()))
        return _kv(resp.kvs[0]) if resp.kvs else None

    async def _range_impl(self, prefix: str, *, start_after: str | None = None, limit: int = 0,
                          descending: bool = False, revision: int = 0) -> RangeResult:
        if descending:
            start = prefix.encode()
            top = start_after if start_after is not None else prefix_end(prefix)
            end = top.encode(errors="surrogateescape")
            request = rpc.RangeRequest(key=start, range_end=end, limit=limit, sort_order=rpc.RangeRequest.DESCEND,
                                       sort_target=rpc.RangeRequest.KEY, revision=revision)
        else:
            start = (start_after.encode() + b"\0") if start_after is not None else prefix.encode()
            end = prefix_end(prefix).encode(errors="surrogateescape")
            request = rpc.RangeRequest(key=start, range_end=end, limit=limit, revision=revision)
        try:
            resp = await self._read_range(request)
        except grpc.aio.AioRpcError as exc:
            # ErrGRPCCompacted: the revision asked for is older than etcd's last compaction.
            if revision and exc.code() == grpc.StatusCode.OUT_OF_RANGE and "compacted" in (exc.details() or ""):
                raise WatchCompacted(0) from exc
            raise
        return RangeResult([_kv(kv) for kv in resp.kvs], bool(resp.more), resp.header.revision)

    # Every call is bounded as a whole: whatever inside the client waits (a reconnect, a stream of a dead
    # member), the caller gets Unavailable within a bounded time, never a hang.
    async def _bounded(self, what: str, call: Awaitable[T]) -> T:
        generation = self._conn.generation
        task = asyncio.ensure_future(call)
        try:
            done, _ = await asyncio.wait({task}, timeout=self._timeout + 1)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if not done:
            # Not awaited: a grpc.aio call can take long to honour cancellation, and waiting for it is
            # exactly the hang this bound exists to prevent.
            task.cancel()
            task.add_done_callback(_consume)
            late = TimeoutError(f"{what} got no answer within {self._timeout + 1:g}s")
            raise await self._conn.fail(late, generation)
        if task.cancelled():
            # Nobody cancelled us: grpc.aio cancels the calls of a channel that is closed under them (a
            # reconnect after another call failed). That is an unavailable store, not a cancellation — let
            # CancelledError escape and a gRPC handler ends without a status, its caller waiting forever.
            raise Unavailable(f"etcd {what} was interrupted by a reconnect to {self.endpoint}; retry")
        return task.result()

    async def get(self, key: str) -> KeyValue | None:
        return await self._bounded("get", self._get_impl(key))

    async def range(self, prefix: str, *, start_after: str | None = None, limit: int = 0,
                    descending: bool = False, revision: int = 0) -> RangeResult:
        return await self._bounded("range", self._range_impl(prefix, start_after=start_after, limit=limit,
                                                             descending=descending, revision=revision))

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        result = await self.txn([], [Put(key, value, lease)])
        return result.revision

    async def delete(self, key: str) -> bool:
        return await self._bounded("delete", self._delete_impl(key))

    async def txn(self, compares: Sequence[Compare], success: Sequence[Op],
                  failure: Sequence[Op] = ()) -> TxnResult:
        return await self._bounded("txn", self._txn_impl(compares, success, failure))

    async def grant_lease(self, ttl_seconds: int) -> int:
        return await self._bounded("grant_lease", self._grant_lease_impl(ttl_seconds))

    async def keepalive(self, lease_id: int) -> int:
        return await self._bounded("keepalive", self._keepalive_impl(lease_id))

    async def revoke_lease(self, lease_id: int) -> None:
        await self._bounded("revoke_lease", self._revoke_lease_impl(lease_id))

    async def _delete_impl(self, key: str) -> bool:
        generation = self._conn.generation
        try:
            resp = await self._conn.call("a delete", key, lambda client: client.kvstub.DeleteRange(
                rpc.DeleteRangeRequest(key=key.encode()), timeout=self._timeout, metadata=client.metadata))
        except _CONNECTION_ERRORS as exc:
            raise await self._conn.fail(exc, generation) from exc
        return bool(resp.deleted)

    async def _txn_impl(self, compares: Sequence[Compare], success: Sequence[Op],
                  failure: Sequence[Op] = ()) -> TxnResult:
        request = _txn_request(compares, success, failure)
        generation = self._conn.generation
        try:
            resp = await self._conn.call("a transaction", _first_key(success, failure, compares), lambda client:
                                    client.kvstub.Txn(request, timeout=self._timeout, metadata=client.metadata))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:  # e.g. "requested lease not found"
                raise FailedPrecondition(f"etcd refused the transaction: {exc.details()}") from exc
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidArgument(f"etcd refused the transaction: {exc.details()}") from exc
            raise await self._conn.fail(exc, generation) from exc
        except _CONNECTION_ERRORS as exc:
            raise await self._conn.fail(exc, generation) from exc
        return TxnResult(bool(resp.succeeded), resp.header.revision)

    async def watch(self, prefix: str, *, start_revision: int = 0) -> AsyncIterator[list[WatchEvent]]:
        generation = self._conn.generation
        key, end = prefix.encode(), prefix_end(prefix).encode(errors="surrogateescape")
        renewed = False
        while True:
            try:
                client = await self._conn.client()
                stale = client.metadata
                stream = watch_responses(client, key, end, start_revision)
                # Not asyncio.wait_for: on Python 3.11 it drops a cancel that lands as the first response
                # arrives, and the watch would then go on for ever under a caller that was stopped.
                async with asyncio.timeout(self._timeout):
                    first = await anext(stream)
                break
            except WatchRefused as refused:
                if client.uses_token and not renewed and is_stale_token(refused):
                    await self._conn.renew(client, stale)
                    renewed = True
                    continue
                if "permission denied" in refused.reason.lower():
                    raise denied("a watch", prefix, self._options, refused) from None
                raise Unavailable(f"etcd refused the watch of {prefix}: {refused.reason}") from None
            except _CONNECTION_ERRORS as exc:
                raise await self._conn.fail(exc, generation) from exc
        try:
            resp = first
            while True:
                if resp.compact_revision:
                    raise WatchCompacted(resp.compact_revision)
                if resp.canceled:
                    raise Unavailable(f"etcd cancelled the watch of {prefix}: {resp.cancel_reason}")
                # One event a batch, as aetcd's watch delivered them (tests hold a watch back by revision).
                for ev in resp.events:
                    kv = ev.kv
                    yield [WatchEvent("put", kv.key.decode(), kv.value, kv.mod_revision) if ev.type == rpc.Event.PUT
                           else WatchEvent("delete", kv.key.decode(), b"", kv.mod_revision)]
                resp = await anext(stream)
        except StopAsyncIteration:
            raise Unavailable(f"etcd ended the watch of {prefix}") from None
        except _CONNECTION_ERRORS as exc:
            raise await self._conn.fail(exc, generation) from exc
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            # The client's channel was closed under the stream (a reconnect): the watcher must reload,
            # not die as if it had been cancelled.
            raise Unavailable(f"etcd watch of {prefix} was interrupted by a reconnect to {self.endpoint}") from None
        finally:
            try:
                await stream.aclose()
            except Exception:  # the stream may already be gone
                log.debug("watch cancel failed", exc_info=True)

    async def _grant_lease_impl(self, ttl_seconds: int) -> int:
        generation = self._conn.generation
        try:
            lease = await self._conn.call("a lease grant", "(lease)", lambda client: client.lease(ttl_seconds))
        except _CONNECTION_ERRORS as exc:
            raise await self._conn.fail(exc, generation) from exc
        return int(lease.id)

    async def _keepalive_impl(self, lease_id: int) -> int:
        generation = self._conn.generation
        try:
            reply = await self._conn.call("a lease keepalive", "(lease)", lambda client: client.refresh_lease(lease_id))
        except _CONNECTION_ERRORS as exc:
            raise await self._conn.fail(exc, generation) from exc
        return int(reply.TTL) if reply is not None else 0

    async def _revoke_lease_impl(self, lease_id: int) -> None:
        generation = self._conn.generation
        try:
            await self._conn.call("a lease revoke", "(lease)", lambda client: client.revoke_lease(lease_id))
        except aetcd.exceptions.ClientError as exc:
            if "not found" in str(exc).lower():
                return
            raise await self._conn.fail(exc, generation) from exc
        except _CONNECTION_ERRORS as exc:
            if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.NOT_FOUND:
                return
            raise await self._conn.fail(exc, generation) from exc

    async def close(self) -> None:
        await self._conn.close()
