"""The POSIX storage's file handling that must hold against what a team's workers plant in their checkpoint
directory (posix.py, "Teams apart"): a shard is opened only as a regular file inside its checkpoint's directory,
and the store's own directories are never links.
"""

from __future__ import annotations

import errno
import os
import stat as stat_mod
from pathlib import Path

from trainyard_core.errors import FailedPrecondition, Unavailable


def inside(path: str, directory: str) -> bool:
    return os.path.commonpath([path, directory]) == directory


def directory_here(path: Path, mode: int) -> os.stat_result:
    """`path` as a directory (made with `mode` if missing), never a link."""
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat_mod.S_ISDIR(st.st_mode):
        raise FailedPrecondition(f"{path} is not a directory (a link or a file in its place)")
    return st


def open_shard(directory: Path, path: str) -> tuple[int, int] | None:
    """An open read-only descriptor of a shard and its size, None when missing; refuses what is not a
    regular file inside the checkpoint's directory. The caller closes the descriptor.

    The real path is checked first (for a clear message), then the file is opened without following a
    final link and without blocking (a FIFO planted in place of a shard would hang a read), and what was
    opened is checked again: a regular file, whose path (the kernel's, /proc/self/fd) is inside the
    directory, so a link swapped in after the look leads nowhere else."""
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
    if not inside(real, real_dir):
        raise FailedPrecondition(f"shard {path!r} is a link that leads outside the checkpoint's "
                                 "directory")
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise FailedPrecondition(f"shard {path!r} became a symbolic link while it was read") from e
        raise Unavailable(f"cannot read shard {path!r} in {directory}: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if not stat_mod.S_ISREG(st.st_mode):
            raise FailedPrecondition(f"shard {path!r} is not a regular file")
        try:
            opened = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            opened = real  # no /proc: the look above is all there is
        if not inside(opened, real_dir):
            raise FailedPrecondition(f"shard {path!r} is a link that leads outside the checkpoint's "
                                     "directory")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size
