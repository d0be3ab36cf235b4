"""A store with faults switched on by the test: the etcd failures a member loss causes, made deterministic.

`FaultyStore` passes every call to the store it wraps, but for the faults armed on it:
- `fail_gets(key, times)`: the next `times` gets of `key` raise Unavailable (-1: every one until
  `heal()`), as a get does on the etcd member that just died;
- `lose_txn_answers(times)`: the next `times` transactions are applied, then raise Unavailable: the write
  landed but its answer was lost on the way back, so its outcome is unknown to the caller.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from trainyard_core.errors import Unavailable
from trainyard_core.store.api import Compare, KeyValue, Op, RangeResult, Store, TxnResult, WatchEvent


class FaultyStore:
    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self._failing_gets: dict[str, int] = {}
        self._lost_txns = 0
        self.failed_gets = 0
        self.lost_txns = 0

    def fail_gets(self, key: str, times: int = -1) -> None:
        self._failing_gets[key] = times

    def lose_txn_answers(self, times: int = 1) -> None:
        self._lost_txns = times

    def heal(self) -> None:
        self._failing_gets.clear()
        self._lost_txns = 0

    async def get(self, key: str) -> KeyValue | None:
        left = self._failing_gets.get(key, 0)
        if left:
            if left > 0:
                self._failing_gets[key] = left - 1
            self.failed_gets += 1
            raise Unavailable(f"etcd at 127.0.0.9:2379 is unavailable: test fault on get {key}")
        return await self.inner.get(key)

    async def txn(self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()) -> TxnResult:
        result = await self.inner.txn(compares, success, failure)
        if self._lost_txns:
            self._lost_txns -= 1
            self.lost_txns += 1
            raise Unavailable("etcd at 127.0.0.9:2379 is unavailable: test fault, the txn's answer was lost")
        return result

    async def range(self, prefix: str, *, start_after: str | None = None, limit: int = 0,
                    descending: bool = False, revision: int = 0) -> RangeResult:
        return await self.inner.range(prefix, start_after=start_after, limit=limit, descending=descending,
                                      revision=revision)

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        return await self.inner.put(key, value, lease=lease)

    async def delete(self, key: str) -> bool:
        return await self.inner.delete(key)

    def watch(self, prefix: str, *, start_revision: int = 0) -> AsyncIterator[list[WatchEvent]]:
        return self.inner.watch(prefix, start_revision=start_revision)

    async def grant_lease(self, ttl_seconds: int) -> int:
        return await self.inner.grant_lease(ttl_seconds)

    async def keepalive(self, lease_id: int) -> int:
        return await self.inner.keepalive(lease_id)

    async def revoke_lease(self, lease_id: int) -> None:
        await self.inner.revoke_lease(lease_id)

    async def close(self) -> None:
        await self.inner.close()

    def __getattr__(self, name: str) -> Any:  # e.g. MemoryStore.compact
        return getattr(self.inner, name)
