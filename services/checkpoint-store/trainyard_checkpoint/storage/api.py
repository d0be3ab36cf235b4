"""Storage interface of the checkpoint-store.

The service never moves checkpoint data: workers write shards straight to a checkpoint's location. The
service needs only to name a location, create it, look at file sizes at commit and remove a deleted
checkpoint. A location is a URL (`file:///root/<job_id>/<checkpoint_id>`, later `s3://...`) and is
stored in the record, so a checkpoint stays where it was written.

Contracts:
- `location_for` is pure and deterministic: `<root>/<job_id>/<checkpoint_id>`.
- `prepare` and `remove` are idempotent (preparing an existing location, removing a missing one succeed).
- `stat` returns the size in bytes of one shard, None when it does not exist. It raises
  FailedPrecondition when the path exists but is not a plain file inside the location (a directory, a
  link leading outside), and Unavailable when the storage cannot be read now.
- Methods that take a location refuse (FailedPrecondition) one that is not under this storage's root,
  so a bad record can never make the service look at or remove files elsewhere.
- Checksums are not read here: commit records the checksums workers declare, and verifying them means
  reading every byte, which belongs on the readers' side (the client library of issue 5 verifies on
  load and falls back to the previous checkpoint). This interface deliberately has no read method yet.
- Every method is safe to call concurrently.
"""

from __future__ import annotations

from typing import Protocol


class CheckpointStorage(Protocol):
    @property
    def url(self) -> str:
        """The storage root, as configured (for logs and errors)."""

    def location_for(self, job_id: str, checkpoint_id: str) -> str: ...

    async def prepare(self, location: str) -> None:
        """Create the location so workers can write into it."""

    async def stat(self, location: str, path: str) -> int | None:
        """Size of the shard at `path` (relative to `location`), None when missing."""

    async def remove(self, location: str) -> None:
        """Remove the location and everything in it."""
