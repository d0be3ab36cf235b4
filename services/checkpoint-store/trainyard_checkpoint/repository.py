"""Checkpoint records in the store (etcd): key layout, JSON encoding and compare-and-swap writes.

Keys, under the service's `etcd_prefix` (see `domain/checkpoint.py` for who writes which and when):

- `{prefix}/checkpoints/<job_id>/<checkpoint_id>` → the record as JSON (`"v": 1`);
- `{prefix}/checkpoint-ids/<checkpoint_id>` → the job id (an immutable index: RPCs name only the id);
- `{prefix}/checkpoints-latest/<job_id>` → the id of the job's latest committed checkpoint.

Every write is a transaction guarded by mod revisions read before it; a lost race returns False and the
caller re-reads and decides again. Nothing here holds a lock or waits on anything but the store.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from trainyard_core.errors import InvalidArgument, Unavailable
from trainyard_core.store import Compare, Put, Store, absent, mod_revision_is

from .domain import Checkpoint, CheckpointState, Shard

RECORD_VERSION = 1
# etcd refuses requests over 1.5 MiB by default; stay clear of it with the whole transaction.
MAX_RECORD_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class StoredCheckpoint:
    checkpoint: Checkpoint
    mod_revision: int


@dataclass(frozen=True, slots=True)
class LatestPointer:
    """The job's latest pointer as read: the checkpoint id (None when the job has none yet) and the
    pointer's mod revision (0 when absent), which guards any transaction that depends on it."""

    checkpoint_id: str | None
    mod_revision: int


def encode(ckpt: Checkpoint) -> bytes:
    doc: dict[str, Any] = {
        "v": RECORD_VERSION,
        "id": ckpt.id,
        "job_id": ckpt.job_id,
        "attempt": ckpt.attempt,
        "step": ckpt.step,
        "world_size": ckpt.world_size,
        "location": ckpt.location,
        "state": ckpt.state.value,
        "created_at": ckpt.created_at,
        "committed_at": ckpt.committed_at,
        "aborted_at": ckpt.aborted_at,
        "deleted_at": ckpt.deleted_at,
        "abort_reason": ckpt.abort_reason,
        "total_bytes": ckpt.total_bytes,
        "shards": [{"path": s.path, "size_bytes": s.size_bytes, "checksum": s.checksum, "rank": s.rank}
                   for s in ckpt.shards],
        "tags": list(ckpt.tags),
        "metadata": dict(ckpt.metadata),
    }
    data = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
    if len(data) > MAX_RECORD_BYTES:
        raise InvalidArgument(f"checkpoint {ckpt.id}'s record would be {len(data)} bytes, more than the "
                              f"{MAX_RECORD_BYTES} the metadata store takes; declare fewer shards or "
                              "shorter paths")
    return data


def decode(data: bytes) -> Checkpoint:
    try:
        doc = json.loads(data)
        if doc.get("v") != RECORD_VERSION:
            raise ValueError(f"unknown record version {doc.get('v')!r}")
        return Checkpoint(
            id=doc["id"], job_id=doc["job_id"], attempt=int(doc["attempt"]), step=int(doc["step"]),
            world_size=int(doc["world_size"]), location=doc["location"],
            state=CheckpointState(doc["state"]), created_at=float(doc["created_at"]),
            shards=tuple(Shard(rank=int(s["rank"]), path=s["path"], size_bytes=int(s["size_bytes"]),
                               checksum=s["checksum"]) for s in doc["shards"]),
            committed_at=doc["committed_at"], aborted_at=doc["aborted_at"], deleted_at=doc["deleted_at"],
            abort_reason=doc["abort_reason"], tags=tuple(doc["tags"]), metadata=dict(doc["metadata"]))
    except (ValueError, KeyError, TypeError) as e:
        # A record this version cannot read is an operator problem, not the caller's: say so plainly.
        raise Unavailable(f"unreadable checkpoint record in the metadata store: {e}") from e


class CheckpointRepository:
    def __init__(self, store: Store, prefix: str) -> None:
        self._store = store
        self._prefix = prefix.rstrip("/")

    # -- keys ---------------------------------------------------------------------------------------
    def job_prefix(self, job_id: str) -> str:
        return f"{self._prefix}/checkpoints/{job_id}/"

    def record_key(self, job_id: str, checkpoint_id: str) -> str:
        return f"{self.job_prefix(job_id)}{checkpoint_id}"

    def index_key(self, checkpoint_id: str) -> str:
        return f"{self._prefix}/checkpoint-ids/{checkpoint_id}"

    def latest_key(self, job_id: str) -> str:
        return f"{self._prefix}/checkpoints-latest/{job_id}"

    # -- reads --------------------------------------------------------------------------------------
    async def load(self, checkpoint_id: str) -> StoredCheckpoint | None:
        index = await self._store.get(self.index_key(checkpoint_id))
        if index is None:
            return None
        kv = await self._store.get(self.record_key(index.value.decode(), checkpoint_id))
        if kv is None:
            return None
        return StoredCheckpoint(decode(kv.value), kv.mod_revision)

    async def load_in_job(self, job_id: str, checkpoint_id: str) -> StoredCheckpoint | None:
        kv = await self._store.get(self.record_key(job_id, checkpoint_id))
        return None if kv is None else StoredCheckpoint(decode(kv.value), kv.mod_revision)

    async def latest_pointer(self, job_id: str) -> LatestPointer:
        kv = await self._store.get(self.latest_key(job_id))
        if kv is None:
            return LatestPointer(None, 0)
        return LatestPointer(kv.value.decode(), kv.mod_revision)

    async def list(self, job_id: str, *, after: str | None, limit: int) -> tuple[list[Checkpoint], bool]:
        """A job's checkpoints in key order (= creation order), after the id `after`; and whether more
        follow."""
        prefix = self.job_prefix(job_id)
        result = await self._store.range(prefix, start_after=prefix + after if after else None,
                                         limit=limit)
        return [decode(kv.value) for kv in result.kvs], result.more

    # -- writes -------------------------------------------------------------------------------------
    async def create(self, ckpt: Checkpoint) -> bool:
        """Store a new record and its id index; False when either key exists already (an id clash)."""
        record_key = self.record_key(ckpt.job_id, ckpt.id)
        index_key = self.index_key(ckpt.id)
        result = await self._store.txn(
            [absent(record_key), absent(index_key)],
            [Put(record_key, encode(ckpt)), Put(index_key, ckpt.job_id.encode())])
        return result.succeeded

    async def update(self, ckpt: Checkpoint, *, expected_revision: int,
                     latest_guard: LatestPointer | None = None, move_latest: bool = False) -> bool:
        """Replace the record if unchanged since `expected_revision`, in one transaction.

        With `latest_guard`, the write also requires the job's latest pointer to be unchanged since it
        was read; with `move_latest`, the pointer is set to this checkpoint in the same transaction.
        """
        record_key = self.record_key(ckpt.job_id, ckpt.id)
        compares: list[Compare] = [mod_revision_is(record_key, expected_revision)]
        ops: list[Put] = [Put(record_key, encode(ckpt))]
        if latest_guard is not None or move_latest:
            if latest_guard is None:
                raise ValueError("moving the latest pointer needs the pointer's revision as a guard")
            compares.append(mod_revision_is(self.latest_key(ckpt.job_id), latest_guard.mod_revision))
        if move_latest:
            ops.append(Put(self.latest_key(ckpt.job_id), ckpt.id.encode()))
        result = await self._store.txn(compares, ops)
        return result.succeeded
