"""Storage interface of the checkpoint-store.

The service never moves checkpoint data: workers write shards straight to a checkpoint's location. The
service names a location, creates it, reads the shards back at commit to verify them, writes the
manifest, lists locations for garbage collection and removes deleted checkpoints. A location is a URL
(`file:///root/<job_id>/<checkpoint_id>` or `s3://bucket/prefix/<job_id>/<checkpoint_id>`) and is stored
in the record, so a checkpoint stays where it was written. `open_storage` (in `__init__`) picks the
backend from the storage URL's scheme.

Contracts:
- `location_for` is pure and deterministic: `<root>/<job_id>/<checkpoint_id>`.
- `check` is called once at start-up; it raises OSError with a message naming the storage and the
  setting to change when the root cannot be used.
- `prepare` and `remove` are idempotent (preparing an existing location, removing a missing one succeed).
- `stat` returns the size in bytes of one shard, None when it does not exist. It raises
  FailedPrecondition when the path exists but is not a plain file inside the location (a directory, a
  link leading outside), and Unavailable when the storage cannot be read now.
- `read_blocks` streams one shard in blocks of at most `block_bytes`. It BLOCKS: call it from a worker
  thread, never on the event loop. Missing → ChecksumMismatch("missing"); same refusals as `stat`.
- `write_once` puts a small file the service owns (the manifest) into a location atomically: a reader
  sees either no file or the whole file, never a part. When the file exists with the same bytes it
  succeeds (a retried commit); with other bytes it raises FailedPrecondition.
- `list_locations` lists the checkpoint locations present in storage (`<root>/<job>/<checkpoint>`),
  only those whose two names are valid ids; anything else under the root is left alone.
- Methods that take a location refuse (FailedPrecondition) one that is not under this storage's root,
  so a bad record can never make the service look at or remove files elsewhere.
- Every method is safe to call concurrently. Credentials are never part of `url` or of a message.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Protocol

from ..domain.gc import StoredLocation


class CheckpointStorage(Protocol):
    @property
    def url(self) -> str:
        """The storage root, as configured (for logs and errors)."""

    def location_for(self, job_id: str, checkpoint_id: str) -> str: ...

    async def check(self) -> None:
        """Start-up check that the root is usable (OSError with an operator's message otherwise)."""

    async def prepare(self, location: str, team: str = "") -> None:
        """Make the location ready for the workers of `team` (the job's recorded team, "" none) to write
        into; FailedPrecondition when this storage keeps teams apart and cannot give it to that team."""

    async def stat(self, location: str, path: str) -> int | None:
        """Size of the shard at `path` (relative to `location`), None when missing."""

    def read_blocks(self, location: str, path: str, block_bytes: int) -> Generator[bytes, None, None]:
        """The shard's bytes, in order, in blocks (blocking: run in a worker thread)."""

    async def write_once(self, location: str, name: str, data: bytes) -> None:
        """Atomically create `name` in the location with `data` (same bytes already there: success)."""

    async def list_locations(self) -> list[StoredLocation]:
        """Every checkpoint location present in storage."""

    async def remove(self, location: str) -> None:
        """Remove the location and everything in it."""

    async def close(self) -> None:
        """Release connections (idempotent)."""
