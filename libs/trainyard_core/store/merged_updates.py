"""Changes to one record asked for by many callers at once, applied together: one read-modify-write for all.

A record that many callers change at the same moment (a gang's allocation, to which each of its workers adds
its exit when the gang ends: 256 calls for a 256-GPU gang) is a compare-and-swap storm when each caller does
its own read-modify-write: every write but one in each round fails its compare and reads again, so n callers
cost O(n²) reads and writes, and the last give up after their tries. Merged, the changes to one key wait while
a write of that key is in flight and then go in the next one, together:

    submit(key, item) ──▶ no write of `key` running: a new one starts (its own task) with this item
                      └─▶ a write of `key` running: the item waits; when that write ends, the next carries
                          every item that waited, in arrival order
    flush(key, items) ──▶ returned r: every caller of that write gets r
                      ──▶ raised: every caller of that write gets the exception (the write is one; it landed
                          for all of its items or for none)

`flush` must treat its items as one change (e.g. add every exit not yet recorded), so the answer it gives is
each caller's. A caller that is cancelled only stops waiting: its item is still written with the others. Keys
are independent: writes of different keys run at the same time. Used from one event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

from .batch import settle_with

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")
R = TypeVar("R")


class MergedUpdates(Generic[K, T, R]):
    def __init__(self, flush: Callable[[K, list[T]], Awaitable[R]]) -> None:
        self._flush = flush
        # key → the items waiting for its next write; present while a writer task of the key runs.
        self._waiting: dict[K, list[tuple[T, asyncio.Future[R]]]] = {}
        self._writers: set[asyncio.Task[None]] = set()

    async def submit(self, key: K, item: T) -> R:
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        waiting = self._waiting.get(key)
        if waiting is not None:
            waiting.append((item, future))
        else:
            self._waiting[key] = [(item, future)]
            writer = asyncio.create_task(self._write(key), name=f"merged updates of {key}")
            self._writers.add(writer)
            writer.add_done_callback(self._writers.discard)
        return await future

    async def _write(self, key: K) -> None:
        batch = self._waiting[key]
        try:
            while batch:
                self._waiting[key] = []  # items from now on go in the next write
                try:
                    result = await self._flush(key, [item for item, _ in batch])
                except BaseException as exc:
                    settle_with((future for _, future in batch), exc)
                    if not isinstance(exc, Exception):
                        raise
                else:
                    for _, future in batch:
                        if not future.done():
                            future.set_result(result)
                batch = self._waiting[key]
        finally:
            settle_with((future for _, future in self._waiting.pop(key, [])),
                        asyncio.CancelledError("the writer of these changes was cancelled"))

    @property
    def busy(self) -> int:
        """Keys with a write in flight."""
        return len(self._waiting)
