"""Where checkpoint files go, and the stream that checksums each file while it is written.

A location is a URL from BeginCheckpoint: `file:///dir` (a local disk or a mounted distributed
filesystem: files are fsync'ed, then the directory) or any fsspec URL such as `s3://bucket/prefix`
(through s3fs when it is installed; an object store has no fsync, a PUT is durable when it returns).

`HashingFileSystem` is a DCP `FileSystemBase`: DCP's writer threads open their files through it, every
byte they write goes through `_HashingStream` (chunked XXH3 as it is written, no second read), and when a
file is closed its size and checksum are recorded for the commit.
"""

from __future__ import annotations

import io
import os
import posixpath
import threading
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast
from urllib.parse import unquote, urlsplit

from torch.distributed.checkpoint.filesystem import FileSystemBase

from ..checksum import ChunkHasher
from .errors import CheckpointError
from .faults import DISABLED, KillPoints


@dataclass(frozen=True, slots=True)
class WrittenFile:
    path: str  # relative to the location
    size_bytes: int
    checksum: str


class Location:
    """A checkpoint directory: local (`local` is its path) or remote through fsspec."""

    def __init__(self, url: str) -> None:
        self.url = url
        parts = urlsplit(url)
        self.local: Path | None = None
        self._fs: Any = None
        if parts.scheme in ("", "file"):
            if parts.netloc not in ("", "localhost"):
                raise CheckpointError(f"location {url!r}: a file:// URL takes no host")
            self.local = Path(unquote(parts.path) if parts.scheme else url)
            self.root: str = str(self.local)
        else:
            try:
                from fsspec.core import url_to_fs  # type: ignore[import-untyped]
            except ImportError:  # pragma: no cover - fsspec comes with the project
                raise CheckpointError(f"location {url!r} needs fsspec (pip install fsspec s3fs)") from None
            try:
                self._fs, root = url_to_fs(url)
            except (ImportError, ValueError) as e:
                raise CheckpointError(f"location {url!r} cannot be opened: {e} (for s3:// install s3fs)") from e
            self.root = str(root).rstrip("/")

    @property
    def remote_fs(self) -> Any:
        return self._fs

    def join(self, name: str) -> str:
        return os.path.join(self.root, name) if self.local is not None else posixpath.join(self.root, name)

    def relative(self, path: str | os.PathLike[str]) -> str:
        text = os.fspath(path)
        prefix = self.root.rstrip("/") + "/"
        if not text.startswith(prefix):
            raise CheckpointError(f"{text} is not inside the checkpoint location {self.url}")
        return text[len(prefix):]

    def size(self, name: str) -> int | None:
        """Size of a file in bytes; None when it does not exist."""
        path = self.join(name)
        if self.local is not None:
            try:
                return os.stat(path).st_size
            except (FileNotFoundError, NotADirectoryError):
                return None
        try:
            return int(self._fs.size(path))
        except FileNotFoundError:
            return None

    def open_read(self, name: str) -> IO[bytes]:
        path = self.join(name)
        if self.local is not None:
            return open(path, "rb")
        return cast(IO[bytes], self._fs.open(path, "rb"))

    def read_all(self, name: str) -> bytes:
        with self.open_read(name) as f:
            return f.read()

    def fsync_dir(self) -> None:
        """Make the directory entries (new names, renames) durable. A no-op on object stores."""
        if self.local is None:
            return
        fd = os.open(self.local, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class _HashingStream(io.IOBase):
    """Write-only stream over a file: hashes and counts every byte. `close()` only flushes; the owning
    `HashingFileSystem.create_stream` makes the file durable and closes it."""

    def __init__(self, raw: IO[bytes], hasher: ChunkHasher, points: KillPoints) -> None:
        super().__init__()
        self._raw = raw
        self._hasher = hasher
        self._points = points
        self._pos = 0
        self._soft_closed = False

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        self._points.hit("before write")
        self._hasher.update(view)
        self._raw.write(view)
        self._pos += len(view)
        self._points.hit("after write")
        return len(view)

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        if not self._soft_closed:
            self._raw.flush()

    def close(self) -> None:
        if not self._soft_closed:
            self._raw.flush()
            self._soft_closed = True

    @property
    def closed(self) -> bool:
        return self._soft_closed


class HashingFileSystem(FileSystemBase):
    """DCP filesystem over a Location whose written files are checksummed as they are written.

    Thread-safe: DCP's writer threads call `create_stream` concurrently; `written()` is read after they
    joined.
    """

    def __init__(self, location: Location, *, chunk_bytes: int, sync_files: bool,
                 points: KillPoints = DISABLED) -> None:
        self.location = location
        self._chunk_bytes = chunk_bytes
        self._sync = sync_files and location.local is not None
        self._points = points
        self._lock = threading.Lock()
        self._written: dict[str, WrittenFile] = {}

    def written(self) -> dict[str, WrittenFile]:
        with self._lock:
            return dict(self._written)

    def _open_raw(self, path: str | os.PathLike[str], mode: str) -> IO[bytes]:
        if self.location.local is not None:
            return cast(IO[bytes], open(path, mode))
        return cast(IO[bytes], self.location.remote_fs.open(os.fspath(path), mode))

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with self._open_raw(path, mode) as raw:
                yield cast(io.IOBase, raw)
            return
        name = self.location.relative(path)
        hasher = ChunkHasher(self._chunk_bytes)
        raw = self._open_raw(path, mode)
        try:
            yield _HashingStream(raw, hasher, self._points)
            raw.flush()
            if self._sync:
                os.fsync(raw.fileno())
                self._points.hit("after fsync")
        finally:
            raw.close()
        with self._lock:
            self._written[name] = WrittenFile(name, hasher.size, str(hasher.result()))
        self._points.hit("after close")

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str | os.PathLike[str]:
        if self.location.local is not None:
            return Path(path) / suffix
        return posixpath.join(os.fspath(path), suffix)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        self._points.hit("before rename")
        if self.location.local is not None:
            os.replace(path, new_path)
        else:
            self.location.remote_fs.mv(os.fspath(path), os.fspath(new_path))
        old, new = self.location.relative(path), self.location.relative(new_path)
        with self._lock:
            record = self._written.pop(old, None)
            if record is not None:
                self._written[new] = WrittenFile(new, record.size_bytes, record.checksum)
        self._points.hit("after rename")

    def init_path(self, path: str | os.PathLike[str]) -> str | os.PathLike[str]:
        return path

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        if self.location.local is not None:
            Path(path).mkdir(parents=True, exist_ok=True)
        else:
            self.location.remote_fs.makedirs(os.fspath(path), exist_ok=True)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True

    def exists(self, path: str | os.PathLike[str]) -> bool:
        if self.location.local is not None:
            return Path(path).exists()
        return bool(self.location.remote_fs.exists(os.fspath(path)))

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        if self.location.local is not None:
            Path(path).unlink()
        else:
            self.location.remote_fs.rm(os.fspath(path))

    def ls(self, path: str | os.PathLike[str]) -> list[str]:
        if self.location.local is not None:
            return [str(p) for p in Path(path).iterdir()]
        return [str(p) for p in self.location.remote_fs.ls(os.fspath(path), detail=False)]

