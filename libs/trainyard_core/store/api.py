"""Store interface.

Contracts every implementation keeps:
- Keys are str (UTF-8 in etcd); values are bytes. Revisions are etcd's: one global counter that grows
  with every successful write, so a key's `mod_revision` is a version usable for compare-and-swap.
- `txn` applies all of `success` atomically when every compare holds, else all of `failure`; it never
  applies a part. It is the only way to write more than one key at once.
- `range` returns keys in byte order; `start_after` and `limit` page through a prefix.
- `watch` yields batches of events in revision order, from `start_revision` (inclusive) when given; a
  watcher that falls behind compaction gets `WatchCompacted` and must reload.
- Every method raises `trainyard_core.errors.Unavailable` when the store cannot be reached; the outcome
  of a write that raised is unknown, so callers re-read before deciding (writes are CAS-guarded).
  `StoreOutOfSpace`, an Unavailable too, is the one whose outcome is known: etcd, at its space quota,
  refused the write before applying anything.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from ..errors import Unavailable


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int = 0


@dataclass(frozen=True, slots=True)
class Compare:
    key: str
    target: Literal["version", "mod", "create", "value"]
    op: Literal["==", "!=", "<", ">"]
    value: int | bytes


def exists(key: str) -> Compare:
    return Compare(key, "version", ">", 0)


def absent(key: str) -> Compare:
    return Compare(key, "version", "==", 0)


def mod_revision_is(key: str, revision: int) -> Compare:
    """Unchanged since it was read at `revision` (0 means: still absent)."""
    return Compare(key, "mod", "==", revision)


def value_is(key: str, value: bytes) -> Compare:
    return Compare(key, "value", "==", value)


@dataclass(frozen=True, slots=True)
class Put:
    key: str
    value: bytes
    lease: int = 0


@dataclass(frozen=True, slots=True)
class Delete:
    key: str
    prefix: bool = False


Op = Put | Delete


@dataclass(frozen=True, slots=True)
class TxnResult:
    succeeded: bool
    revision: int


@dataclass(frozen=True, slots=True)
class RangeResult:
    kvs: list[KeyValue]
    more: bool
    revision: int


@dataclass(frozen=True, slots=True)
class WatchEvent:
    kind: Literal["put", "delete"]
    key: str
    value: bytes
    mod_revision: int


class WatchCompacted(Unavailable):
    """The requested start revision was compacted away; reload and watch from the new revision."""

    def __init__(self, compacted_revision: int) -> None:
        super().__init__(f"watch start revision compacted (now at {compacted_revision})")
        self.compacted_revision = compacted_revision


class Store(Protocol):
    async def get(self, key: str) -> KeyValue | None: ...

    async def range(self, prefix: str, *, start_after: str | None = None, limit: int = 0,
                    descending: bool = False, revision: int = 0) -> RangeResult:
        """Keys starting with `prefix`, after `start_after` (exclusive), at most `limit` (0: all), in key order.
        `descending`: largest key first, and `start_after` is then the cursor in that direction (only keys
        below it): pass the last key of a page to get the next one either way. `revision`: as the keys were at
        that revision (0: now), so that the pages of one read are one snapshot; WatchCompacted when that
        revision is no longer kept."""

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        """Unconditional write; returns the new revision."""

    async def delete(self, key: str) -> bool:
        """Returns whether the key existed."""

    async def txn(self, compares: Sequence[Compare], success: Sequence[Op],
                  failure: Sequence[Op] = ()) -> TxnResult: ...

    def watch(self, prefix: str, *, start_revision: int = 0) -> AsyncIterator[list[WatchEvent]]:
        """Batches of events under `prefix`. Closing the iterator (aclose) cancels the watch."""

    async def grant_lease(self, ttl_seconds: int) -> int: ...

    async def keepalive(self, lease_id: int) -> int:
        """Refreshes a lease; returns its remaining TTL, 0 when it has already expired."""

    async def revoke_lease(self, lease_id: int) -> None:
        """Idempotent: revoking an expired or unknown lease succeeds."""

    async def close(self) -> None: ...


def prefix_end(prefix: str) -> str:
    """The first key after every key that starts with `prefix` (etcd's range_end)."""
    raw = bytearray(prefix.encode())
    for i in range(len(raw) - 1, -1, -1):
        if raw[i] < 0xFF:
            raw[i] += 1
            return bytes(raw[: i + 1]).decode(errors="surrogateescape")
    return "\0"
