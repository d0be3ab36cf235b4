"""POSIX directory storage: a local disk or a mounted distributed filesystem (Lustre, GPFS, CephFS,
JuiceFS, 3FS). Layout: `<root>/<job_id>/<checkpoint_id>/<shard path>`.

This backend talks to the filesystem through `os` rather than fsspec's LocalFileSystem: it needs what
that layer does not give, fsync of files and directories, exclusive link-into-place, and real-path
containment checks against links planted in a checkpoint directory.

Filesystem calls block (and take milliseconds on a busy parallel filesystem), so each runs in a worker
thread; the event loop keeps serving other calls meanwhile.
"""

from __future__ import annotations

import asyncio
import errno
import os
import secrets
import shutil
import stat as stat_mod
from collections.abc import Generator
from pathlib import Path
from urllib.parse import unquote, urlsplit

from trainyard_core.errors import FailedPrecondition, Unavailable
from trainyard_core.ids import is_valid_id

from ..checksum import ChecksumMismatch
from ..domain.gc import StoredLocation
from ..domain.validation import is_checkpoint_id

# Errors from link() that mean "this filesystem has no hard links", not "something is wrong".
_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK, errno.ENOSYS}


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
                                   "(set --storage-url / TRAINYARD_CHECKPOINT_STORE_STORAGE_URL)") from e
        if not os.access(self._root, os.W_OK | os.X_OK):
            raise OSError(errno.EACCES, f"checkpoint storage root {self._root} is not writable by this "
                                        "process (set --storage-url / TRAINYARD_CHECKPOINT_STORE_STORAGE_URL)")
        self._real_root = Path(os.path.realpath(self._root))

    async def check(self) -> None:
        await asyncio.to_thread(self.ensure_root)

    async def close(self) -> None:
        return None

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

    def _resolve(self, directory: Path, path: str) -> tuple[str, int] | None:
        """The real path of a shard and its size, None when missing; refuses what is not a regular file
        inside the checkpoint's directory."""
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
        return real, st.st_size

    async def stat(self, location: str, path: str) -> int | None:
        directory = self._directory(location)
        found = await asyncio.to_thread(self._resolve, directory, path)
        return None if found is None else found[1]

    def read_blocks(self, location: str, path: str, block_bytes: int) -> Generator[bytes, None, None]:
        directory = self._directory(location)
        found = self._resolve(directory, path)
        if found is None:
            raise ChecksumMismatch(path, "missing")
        try:
            f = open(found[0], "rb", buffering=0)  # noqa: SIM115 - closed below, a generator spans it
        except FileNotFoundError:
            raise ChecksumMismatch(path, "missing") from None
        except OSError as e:
            raise Unavailable(f"cannot read shard {path!r} in {directory}: {e.strerror}") from e
        with f:
            try:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            except (AttributeError, OSError):
                pass
            while True:
                try:
                    block = f.read(block_bytes)
                except OSError as e:
                    raise Unavailable(f"cannot read shard {path!r} in {directory}: {e.strerror}") from e
                if not block:
                    return
                yield block

    def _write_once_sync(self, directory: Path, name: str, data: bytes) -> None:
        final = directory / name
        tmp = directory / f"{name}.tmp-{secrets.token_hex(6)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            # link() is an exclusive create of the finished file: it fails when the name exists, so two
            # concurrent commits cannot both put their manifest in place. Filesystems without hard links
            # fall back to rename after a look (the look and the rename are not one step there).
            try:
                os.link(tmp, final)
            except FileExistsError:
                self._same_or_refuse(final, data)
            except OSError as e:
                if e.errno not in _NO_LINKS:
                    raise
                if final.exists():
                    self._same_or_refuse(final, data)
                else:
                    os.rename(tmp, final)
            _fsync_dir(directory)
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass

    @staticmethod
    def _same_or_refuse(final: Path, data: bytes) -> None:
        if final.read_bytes() != data:
            raise FailedPrecondition(f"{final.name} already exists in {final.parent} with other content: "
                                     "another commit of this checkpoint with a different shard list got "
                                     "there first; begin a new checkpoint")

    async def write_once(self, location: str, name: str, data: bytes) -> None:
        directory = self._directory(location)
        try:
            await asyncio.to_thread(self._write_once_sync, directory, name, data)
        except FileNotFoundError as e:
            raise FailedPrecondition(f"checkpoint directory {directory} does not exist") from e
        except OSError as e:
            raise Unavailable(f"cannot write {name} in {directory}: {e.strerror}") from e

    def _list_sync(self) -> list[StoredLocation]:
        out: list[StoredLocation] = []
        try:
            jobs = list(os.scandir(self._root))
        except FileNotFoundError:
            return out
        for job in jobs:
            if not is_valid_id(job.name) or not job.is_dir(follow_symlinks=False):
                continue
            try:
                entries = list(os.scandir(job.path))
            except (FileNotFoundError, NotADirectoryError):
                continue
            for entry in entries:
                # A link in place of a checkpoint directory is listed too, so that GC removes the link.
                if is_checkpoint_id(entry.name) and (entry.is_dir(follow_symlinks=False) or entry.is_symlink()):
                    out.append(StoredLocation(job.name, entry.name, self.location_for(job.name, entry.name)))
        return out

    async def list_locations(self) -> list[StoredLocation]:
        try:
            return await asyncio.to_thread(self._list_sync)
        except OSError as e:
            raise Unavailable(f"cannot list checkpoint storage {self._root}: {e.strerror}") from e

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
