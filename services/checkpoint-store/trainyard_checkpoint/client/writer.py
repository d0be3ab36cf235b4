"""DCP StorageWriter that writes a standard DCP checkpoint (`__<rank>_<n>.distcp` files and `.metadata`)
and knows, for every file, its size and chunked XXH3 checksum, computed while the bytes were written.

It builds on DCP's FileSystemWriter: the same planning, the same file format and the same per-rank
writer threads (`thread_count` files per rank, written in parallel), so stock `dcp.load` with a plain
`FileSystemReader` reads what it writes. What it adds:

- every file goes through `HashingFileSystem` (checksummed as written; fsync'ed; the directory fsync'ed);
- each rank's list of files rides back to the coordinator on DCP's own gather of write results (attached
  to the rank's first `WriteResult`, removed again before `.metadata` is written, so `.metadata` holds
  only stock DCP types);
- `finish` on the coordinator writes `.metadata` (temp name, fsync, rename, directory fsync), then hands
  the complete file list to `on_complete` (the client commits it through the service there). An error in
  `on_complete` reaches every rank as DCP's failure of the save.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    FileSystemWriter,
    _split_by_size_and_type,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..checksum import CHUNK_BYTES
from .faults import DISABLED, KillPoints
from .service import ShardRecord
from .storage import HashingFileSystem, Location

METADATA_FILE = ".metadata"


@dataclass(frozen=True, slots=True)
class _FilesOfRank:
    """Wraps the storage_data of a rank's first WriteResult to carry that rank's files to finish()."""

    storage_data: Any
    files: tuple[ShardRecord, ...]


class TrainyardWriter(FileSystemWriter):
    def __init__(self, location: str, *, thread_count: int = 2, chunk_bytes: int = CHUNK_BYTES,
                 sync_files: bool = True, on_complete: Callable[[list[ShardRecord]], None] | None = None,
                 points: KillPoints = DISABLED) -> None:
        # DCP's own fsync falls back to os.sync() on streams without a file descriptor (every object
        # store); the HashingFileSystem fsyncs local files itself, so DCP's is turned off.
        super().__init__(location, single_file_per_rank=True, sync_files=False, thread_count=thread_count,
                         overwrite=False)
        self.location = Location(location)
        self.files_fs = HashingFileSystem(self.location, chunk_bytes=chunk_bytes, sync_files=sync_files,
                                          points=points)
        self.fs = cast(Any, self.files_fs)  # DCP types it as its own FileSystem; any FileSystemBase works
        self.path = self.location.local if self.location.local is not None else self.location.root
        self._on_complete = on_complete
        self._points = points
        self.files: list[ShardRecord] = []

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        # As FileSystemWriter.write_data, except that a bucket with nothing in it gets no file: every
        # file written is then one that some WriteResult refers to, and is declared at commit.
        prefix = plan.storage_data.prefix
        file_queue: queue.Queue[Any] = queue.Queue()
        for n, bucket in enumerate(_split_by_size_and_type(self.thread_count, plan.items)):
            if bucket:
                name = f"{prefix}{n}{DEFAULT_SUFFIX}"
                file_queue.put((self.fs.concat_path(self.path, name), name, bucket))
        done = self._write_data(planner, file_queue)
        results: list[WriteResult] = done.wait()
        self.location.fsync_dir()
        rank = int(self.rank or 0)
        files = tuple(sorted(ShardRecord(w.path, w.size_bytes, w.checksum, rank)
                             for w in self.files_fs.written().values()))
        self._points.hit("files written")
        if results:
            first = results[0]
            results[0] = WriteResult(index=first.index, size_in_bytes=first.size_in_bytes,
                                     storage_data=_FilesOfRank(first.storage_data, files))
        out: Future[list[WriteResult]] = Future()
        out.set_result(results)
        return out

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        files: list[ShardRecord] = []
        plain: list[list[WriteResult]] = []
        for rank_results in results:
            unwrapped = []
            for r in rank_results:
                if isinstance(r.storage_data, _FilesOfRank):
                    files.extend(r.storage_data.files)
                    r = WriteResult(index=r.index, size_in_bytes=r.size_in_bytes,
                                    storage_data=r.storage_data.storage_data)
                unwrapped.append(r)
            plain.append(unwrapped)
        super().finish(metadata, plain)
        self.location.fsync_dir()
        self._points.hit("metadata written")
        meta = self.files_fs.written()[METADATA_FILE]
        files.append(ShardRecord(meta.path, meta.size_bytes, meta.checksum, int(self.rank or 0)))
        self.files = sorted(files, key=lambda f: (f.rank, f.path))
        if self._on_complete is not None:
            self._on_complete(self.files)
