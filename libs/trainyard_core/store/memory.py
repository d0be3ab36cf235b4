"""In-memory twin of the etcd store, for pure-logic tests. Same contract (see api.py), one process."""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import AsyncIterator, Sequence

from ..clock import Clock, SystemClock
from .api import Compare, Delete, KeyValue, Op, Put, RangeResult, TxnResult, WatchCompacted, WatchEvent


class MemoryStore:
    def __init__(self, clock: Clock | None = None) -> None:
        self._data: dict[str, KeyValue] = {}
        self._keys: list[str] = []  # sorted
        self._revision = 1
        self._history: list[WatchEvent] = []
        self._compacted = 0
        self._watchers: list[tuple[str, asyncio.Queue[list[WatchEvent]]]] = []
        self._leases: dict[int, tuple[int, float]] = {}  # id -> (ttl, expires_at monotonic)
        self._next_lease = 1000
        self._clock = clock or SystemClock()
        self.available = True

    # -- helpers -----------------------------------------------------------------------------------
    def _check(self) -> None:
        if not self.available:
            from ..errors import Unavailable

            raise Unavailable("store is unavailable (test switch)")

    def _expire(self) -> None:
        now = self._clock.monotonic()
        dead = [lid for lid, (_, exp) in self._leases.items() if exp <= now]
        if dead:
            events: list[WatchEvent] = []
            self._revision += 1
            for lid in dead:
                del self._leases[lid]
                for key in [k for k, kv in self._data.items() if kv.lease == lid]:
                    events.append(self._remove(key))
            self._publish(events)

    def _remove(self, key: str) -> WatchEvent:
        del self._data[key]
        self._keys.pop(bisect.bisect_left(self._keys, key))
        return WatchEvent("delete", key, b"", self._revision)

    def _publish(self, events: list[WatchEvent]) -> None:
        if not events:
            return
        self._history.extend(events)
        for prefix, queue in self._watchers:
            mine = [e for e in events if e.key.startswith(prefix)]
            if mine:
                queue.put_nowait(mine)

    def _holds(self, c: Compare) -> bool:
        kv = self._data.get(c.key)
        if c.target == "value":
            actual: int | bytes = kv.value if kv else b""
        elif c.target == "version":
            actual = kv.version if kv else 0
        elif c.target == "mod":
            actual = kv.mod_revision if kv else 0
        else:
            actual = kv.create_revision if kv else 0
        if c.op == "==":
            return actual == c.value
        if c.op == "!=":
            return actual != c.value
        if c.op == "<":
            return actual < c.value  # type: ignore[operator]
        return actual > c.value  # type: ignore[operator]

    def _check_leases(self, ops: Sequence[Op]) -> None:
        # As etcd: a put under a lease that does not exist fails the whole transaction, before any change.
        for op in ops:
            if isinstance(op, Put) and op.lease and op.lease not in self._leases:
                from ..errors import FailedPrecondition

                raise FailedPrecondition(f"lease {op.lease} not found")

    def _apply(self, ops: Sequence[Op]) -> list[WatchEvent]:
        events: list[WatchEvent] = []
        for op in ops:
            if isinstance(op, Put):
                old = self._data.get(op.key)
                if old is None:
                    bisect.insort(self._keys, op.key)
                self._data[op.key] = KeyValue(
                    key=op.key, value=op.value,
                    create_revision=old.create_revision if old else self._revision,
                    mod_revision=self._revision, version=(old.version + 1) if old else 1, lease=op.lease)
                events.append(WatchEvent("put", op.key, op.value, self._revision))
            elif isinstance(op, Delete):
                if op.prefix:
                    for key in [k for k in self._keys if k.startswith(op.key)]:
                        events.append(self._remove(key))
                elif op.key in self._data:
                    events.append(self._remove(op.key))
        return events

    # -- Store -------------------------------------------------------------------------------------
    async def get(self, key: str) -> KeyValue | None:
        self._check()
        self._expire()
        return self._data.get(key)

    async def range(self, prefix: str, *, start_after: str | None = None, limit: int = 0,
                    descending: bool = False, revision: int = 0) -> RangeResult:
        self._check()
        self._expire()
        if revision and revision != self._revision:
            # This twin keeps no old versions: a read at a past revision is refused as etcd refuses a
            # compacted one (the caller reads again from now).
            raise WatchCompacted(self._revision)
        lo = bisect.bisect_left(self._keys, prefix)
        hi = lo
        while hi < len(self._keys) and self._keys[hi].startswith(prefix):
            hi += 1
        if start_after is not None:
            if descending:
                hi = min(hi, bisect.bisect_left(self._keys, start_after))
            else:
                lo = max(lo, bisect.bisect_right(self._keys, start_after))
        keys = self._keys[lo:hi]
        if descending:
            keys = keys[::-1]
        more = bool(limit) and len(keys) > limit
        out = [self._data[k] for k in (keys[:limit] if limit else keys)]
        return RangeResult(out, more, self._revision)

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        result = await self.txn([], [Put(key, value, lease)])
        return result.revision

    async def delete(self, key: str) -> bool:
        existed = key in self._data
        await self.txn([], [Delete(key)])
        return existed

    async def txn(self, compares: Sequence[Compare], success: Sequence[Op],
                  failure: Sequence[Op] = ()) -> TxnResult:
        self._check()
        self._expire()
        ok = all(self._holds(c) for c in compares)
        ops = success if ok else failure
        self._check_leases(ops)
        writes = any(isinstance(o, Put) or (isinstance(o, Delete) and (
            o.key in self._data or (o.prefix and any(k.startswith(o.key) for k in self._keys))))
            for o in ops)
        if writes:
            self._revision += 1
        events = self._apply(ops)
        self._publish(events)
        return TxnResult(ok, self._revision)

    async def watch(self, prefix: str, *, start_revision: int = 0) -> AsyncIterator[list[WatchEvent]]:
        self._check()
        if start_revision and start_revision <= self._compacted:
            raise WatchCompacted(self._compacted)
        queue: asyncio.Queue[list[WatchEvent]] = asyncio.Queue()
        if start_revision:
            backlog = [e for e in self._history if e.mod_revision >= start_revision and
                       e.key.startswith(prefix)]
            if backlog:
                queue.put_nowait(backlog)
        entry = (prefix, queue)
        self._watchers.append(entry)
        try:
            while True:
                yield await queue.get()
        finally:
            self._watchers.remove(entry)

    async def grant_lease(self, ttl_seconds: int) -> int:
        self._check()
        self._next_lease += 1
        self._leases[self._next_lease] = (ttl_seconds, self._clock.monotonic() + ttl_seconds)
        return self._next_lease

    async def keepalive(self, lease_id: int) -> int:
        self._check()
        self._expire()
        if lease_id not in self._leases:
            return 0
        ttl, _ = self._leases[lease_id]
        self._leases[lease_id] = (ttl, self._clock.monotonic() + ttl)
        return ttl

    async def revoke_lease(self, lease_id: int) -> None:
        self._check()
        if lease_id in self._leases:
            self._leases[lease_id] = (0, float("-inf"))
            self._expire()

    def compact(self) -> None:
        """Drop the watch history (as etcd compaction does)."""
        self._compacted = self._revision
        self._history.clear()

    async def close(self) -> None:
        return None
