"""POSIX directory storage: a local disk or a mounted distributed filesystem (Lustre, GPFS, CephFS,
JuiceFS, 3FS). Layout: `<root>/<job_id>/<checkpoint_id>/<shard path>`.

Filesystem calls block (and take milliseconds on a busy parallel filesystem), so each runs in a worker
thread; the event loop keeps serving other calls meanwhile.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import stat as stat_mod
from pathlib import Path
from urllib.parse import unquote, urlsplit

from trainyard_core.errors import FailedPrecondition, Unavailable


class PosixStorage:
    def __init__(self, root: Path) -> None:
        if not root.is_absolute():
            raise ValueError(f"storage root {root} must be an absolute path")
        self._root = root
        # Containment checks compare real paths, so a root reached through a symlink still works.
        self._real_root = Path(os.path.realpath(root))

    @property
    def url(self) -> str:
        return self._root.as_uri()

    @property
    def root(self) -> Path:
        return self._root

    def ensure_root(self) -> None:
        """Create the root if needed and check it is a writable directory (called once at start-up).

        Raises OSError with a message that names the path and the setting to change.
        """
        try:
            self._root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OSError(e.errno, f"cannot create checkpoint storage root {self._root}: {e.strerror} "
                                   "(set --storage-url / TRAINYARD_CHECKPOINT_STORAGE_URL)") from e
        if not os.access(self._root, os.W_OK | os.X_OK):
            raise OSError(errno.EACCES, f"checkpoint storage root {self._root} is not writable by this "
                                        "process (set --storage-url / TRAINYARD_CHECKPOINT_STORAGE_URL)")
        self._real_root = Path(os.path.realpath(self._root))

    def location_for(self, job_id: str, checkpoint_id: str) -> str:
        return (self._root / job_id / checkpoint_id).as_uri()

    def _directory(self, location: str) -> Path:
        parts = urlsplit(location)
        if parts.scheme != "file" or parts.netloc not in ("", "localhost"):
            raise FailedPrecondition(f"location {location!r} is not a file:// URL of this storage "
                                     f"({self.url})")
        path = Path(unquote(parts.path))
        try:
            rel = path.relative_to(self._root)
        except ValueError:
            raise FailedPrecondition(f"location {location!r} is not under this storage's root "
                                     f"({self.url})") from None
        if len(rel.parts) != 2 or ".." in rel.parts:
            raise FailedPrecondition(f"location {location!r} is not a checkpoint directory "
                                     f"(<root>/<job_id>/<checkpoint_id>) of {self.url}")
        return path

    async def prepare(self, location: str) -> None:
        directory = self._directory(location)
        try:
            await asyncio.to_thread(directory.mkdir, parents=True, exist_ok=True)
        except OSError as e:
            raise Unavailable(f"cannot create checkpoint directory {directory}: {e.strerror}") from e

    def _stat_sync(self, directory: Path, path: str) -> int | None:
        full = directory / path
        try:
            real = os.path.realpath(full, strict=True)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise FailedPrecondition(f"shard {path!r} is a symbolic link loop") from e
            raise Unavailable(f"cannot read shard {path!r} in {directory}: {e.strerror}") from e
        real_dir = os.path.realpath(directory)
        if os.path.commonpath([real, real_dir]) != real_dir:
            raise FailedPrecondition(f"shard {path!r} is a link that leads outside the checkpoint's "
                                     "directory")
        try:
            st = os.stat(real)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise Unavailable(f"cannot read shard {path!r} in {directory}: {e.strerror}") from e
        if not stat_mod.S_ISREG(st.st_mode):
            raise FailedPrecondition(f"shard {path!r} is not a regular file")
        return st.st_size

    async def stat(self, location: str, path: str) -> int | None:
        directory = self._directory(location)
        return await asyncio.to_thread(self._stat_sync, directory, path)

    def _remove_sync(self, directory: Path) -> None:
        if directory.is_symlink():
            # Never follow a link planted in place of a checkpoint directory; remove the link only.
            directory.unlink()
            return
        try:
            shutil.rmtree(directory)
        except FileNotFoundError:
            return

    async def remove(self, location: str) -> None:
        directory = self._directory(location)
        try:
            await asyncio.to_thread(self._remove_sync, directory)
        except OSError as e:
            raise Unavailable(f"cannot remove checkpoint directory {directory}: {e.strerror}") from e
