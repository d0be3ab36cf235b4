"""The history store as the scheduler's parts reach it: opened on first use and again after a failed open, so
a database that is down when the scheduler starts delays archiving and history reads, and nothing else."""

from __future__ import annotations

import asyncio

from .store import HistoryStore


class History:
    def __init__(self, url: str) -> None:
        self._url = url
        self._store: HistoryStore | None = None
        self._lock = asyncio.Lock()

    async def store(self) -> HistoryStore:
        """The open store; HistoryUnavailable while it cannot be opened (tried again at the next call)."""
        if self._store is not None:
            return self._store
        async with self._lock:
            if self._store is None:
                self._store = await HistoryStore.open(self._url)
            return self._store

    async def close(self) -> None:
        if self._store is not None:
            await self._store.close()
            self._store = None
