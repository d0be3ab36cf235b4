"""Commit-time verification of a checkpoint's shards in storage: existence, size and (checksum mode) the
declared per-chunk checksum, read back from storage.

Reading is blocking I/O (a file, or ranged GETs through s3fs) and hashing is CPU (XXH3 releases the GIL),
so shards are verified in this verifier's own thread pool of `concurrency` threads, several at once; the
event loop only waits. A bad shard is reported, not raised: the commit collects every problem and
refuses with all of them (up to a limit), naming each shard and, for a checksum mismatch, the chunk.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Sequence
from typing import Literal

from . import checksum, domain
from .domain import Shard
from .storage import CheckpointStorage

BLOCK_BYTES = 8 * 1024 * 1024
VerifyMode = Literal["checksum", "size"]


class ShardVerifier:
    def __init__(self, storage: CheckpointStorage, *, mode: VerifyMode = "checksum", concurrency: int = 8,
                 block_bytes: int = BLOCK_BYTES) -> None:
        self._storage = storage
        self.mode: VerifyMode = mode
        self._concurrency = concurrency
        self._block_bytes = block_bytes
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=concurrency,
                                                           thread_name_prefix="ckpt-verify")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def problems(self, location: str, shards: Sequence[Shard], *, mode: VerifyMode | None = None) -> list[str]:
        """One message per bad shard; empty when every shard is as declared. Raises FailedPrecondition
        (a shard that is not a regular file inside the location) or Unavailable (storage unreadable).
        `mode` overrides the verifier's own (a damage report is always checked by checksum)."""
        mode = mode or self.mode
        limit = asyncio.Semaphore(max(self._concurrency * 4, 32))

        async def size_of(shard: Shard) -> tuple[str, int | None]:
            async with limit:
                return shard.path, await self._storage.stat(location, shard.path)

        # gather, not a TaskGroup: the first domain error must reach the error mapping as itself.
        sizes = dict(await asyncio.gather(*(size_of(s) for s in shards)))
        found = domain.storage_problems(shards, sizes)
        if found or mode == "size":
            return found
        loop = asyncio.get_running_loop()
        results = await asyncio.gather(*(loop.run_in_executor(self._pool, self._check_one, location, s)
                                         for s in shards))
        return [r for r in results if r]

    def _check_one(self, location: str, shard: Shard) -> str:
        expected = checksum.parse(shard.checksum)
        try:
            blocks = self._storage.read_blocks(location, shard.path, self._block_bytes)
            try:
                checksum.verify_blocks(shard.path, blocks, expected, shard.size_bytes)
            finally:
                blocks.close()  # closes the file at once when a mismatch stopped the reading early
        except checksum.ChecksumMismatch as e:
            return f"shard {shard.path!r} (rank {shard.rank}) does not match its checksum: {e.detail}"
        return ""
