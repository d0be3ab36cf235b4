"""POSIX directory storage: a local disk or a mounted distributed filesystem (Lustre, GPFS, CephFS,
JuiceFS, 3FS). Layout: `<root>/<job_id>/<checkpoint_id>/<shard path>`.

This backend talks to the filesystem through `os` rather than fsspec's LocalFileSystem: it needs what
that layer does not give, fsync of files and directories, exclusive link-into-place, and real-path
containment checks against links planted in a checkpoint directory.

Filesystem calls block (and take milliseconds on a busy parallel filesystem), so each runs in a worker
thread; the event loop keeps serving other calls meanwhile.

Teams apart (`owners`, the store's `run_as`: the same team → uid:gid mapping the agents run workers as). A
team's workers cannot write into a directory of the store's own, and must not read another team's shards,
so with a mapping:
- the root is 0711 (others pass through to their job's directory by name, cannot list job ids), and every
  directory above it must let others pass;
- `<root>/<job_id>` is the store's, 0711: nobody but the store creates, renames or replaces entries in it, so
  a checkpoint directory's path always leads where the store made it;
- `<root>/<job_id>/<checkpoint_id>` is made 0700 and handed to the job's team's uid:gid: its workers write
  their shards there (as their uid, umask 077), nobody else of another uid reads them.
The store then reads, verifies and removes files its workers own, so it runs as root; everything it opens in
a team's directory is opened without following a final symbolic link, and checked after opening to lie
inside the checkpoint's directory (a link swapped in between a look and an open leads nowhere else).
"""

from __future__ import annotations

import asyncio
import errno
import os
import secrets
import shutil
import stat as stat_mod
from collections.abc import Generator, Mapping
from pathlib import Path
from urllib.parse import unquote, urlsplit

from trainyard_core.errors import FailedPrecondition, Unavailable
from trainyard_core.files import closed_parent
from trainyard_core.ids import is_valid_id
from trainyard_core.security.unix_ids import Identity

from ..checksum import ChecksumMismatch
from ..domain.gc import StoredLocation
from ..domain.validation import is_checkpoint_id
from .posix_files import directory_here, open_shard

# Errors from link() that mean "this filesystem has no hard links", not "something is wrong".
_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK, errno.ENOSYS}
# With owners: the root and each job's directory let others pass by name, not list; a checkpoint's is its team's.
PASS_MODE = 0o711
PRIVATE_MODE = 0o700


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class PosixStorage:
    def __init__(self, root: Path, owners: Mapping[str, Identity] | None = None) -> None:
        if not root.is_absolute():
            raise ValueError(f"storage root {root} must be an absolute path")
        self._root = root
        self._owners = dict(owners or {})
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
        if self._owners:
            self._ensure_shared_root()

    def _ensure_shared_root(self) -> None:
        """With owners: a store running as root, a root of its own that others may pass, not list, under
        parents they may pass. OSError saying what to change."""
        if os.geteuid() != 0:
            raise OSError(errno.EPERM, f"run_as needs the checkpoint-store to run as root (it runs as uid "
                                       f"{os.geteuid()}): it hands each checkpoint directory to its team's uid and "
                                       "reads and removes what the workers wrote there. Run it as root, or leave "
                                       "run_as empty (one team, or S3 storage)")
        st = os.lstat(self._root)
        if not stat_mod.S_ISDIR(st.st_mode) or st.st_uid != 0:
            raise OSError(errno.EPERM, f"checkpoint storage root {self._root} must be a directory of root's, not a "
                                       f"link or uid {st.st_uid}'s: whoever owns it could swap one job's "
                                       "checkpoints for another's")
        os.chmod(self._root, PASS_MODE)
        closed = closed_parent(self._root)
        if closed is not None:
            parent, mode = closed
            raise OSError(errno.EACCES, f"workers cannot reach their checkpoint directories under {self._root}: "
                                        f"{parent} is mode {mode:04o}, which other users may not pass through "
                                        f"(chmod o+x {parent}, or put the storage under directories they may pass)")

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

    def owner_of(self, team: str) -> Identity | None:
        """Whose a job's checkpoint directories are: None, the store's own (no owners); FailedPrecondition for
        a job with no team, or a team without an identity, when teams are kept apart."""
        if not self._owners:
            return None
        found = self._owners.get(team)
        if found is not None:
            return found
        if not team:
            raise FailedPrecondition("this job has no team recorded (its checkpoints are begun by its workers, "
                                     "with the credential the scheduler gives them), and with run_as a "
                                     "checkpoint directory must belong to a team")
        raise FailedPrecondition(f"team {team!r} has no Unix identity on the checkpoint storage: add it to the "
                                 f"checkpoint-store's run_as (e.g. --run-as {team}=<uid>:<gid>, as on the agents)")

    def _prepare_sync(self, directory: Path, owner: Identity | None) -> None:
        if owner is None:
            directory.mkdir(parents=True, exist_ok=True)
            return
        # The root is the store's (ensure_root); the job's directory too, so nothing in it can be swapped.
        job = directory.parent
        st = directory_here(job, PASS_MODE)
        if st.st_uid != 0:
            raise FailedPrecondition(f"the job's checkpoint directory {job} belongs to uid {st.st_uid}, not to the "
                                     "store: remove it (its checkpoints would be at the mercy of that user)")
        os.chmod(job, PASS_MODE, follow_symlinks=False)
        directory_here(directory, PRIVATE_MODE)
        os.chown(directory, owner.uid, owner.gid, follow_symlinks=False)
        os.chmod(directory, PRIVATE_MODE, follow_symlinks=False)

    async def prepare(self, location: str, team: str = "") -> None:
        directory = self._directory(location)
        owner = self.owner_of(team)
        try:
            await asyncio.to_thread(self._prepare_sync, directory, owner)
        except OSError as e:
            raise Unavailable(f"cannot create checkpoint directory {directory}: {e.strerror}") from e

    async def stat(self, location: str, path: str) -> int | None:
        directory = self._directory(location)
        found = await asyncio.to_thread(open_shard, directory, path)
        if found is None:
            return None
        os.close(found[0])
        return found[1]

    def read_blocks(self, location: str, path: str, block_bytes: int) -> Generator[bytes, None, None]:
        directory = self._directory(location)
        found = open_shard(directory, path)
        if found is None:
            raise ChecksumMismatch(path, "missing")
        f = os.fdopen(found[0], "rb", buffering=0)
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
        # Not following a link: in a team's directory, its workers could have put one there.
        try:
            fd = os.open(final, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            fd = -1
        if fd >= 0:
            with os.fdopen(fd, "rb") as f:
                same = stat_mod.S_ISREG(os.fstat(f.fileno()).st_mode) and f.read(len(data) + 1) == data
        if fd < 0 or not same:
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
