"""Files: reading operator-provided YAML/JSON (settings, policies, topology) with errors that name the file,
replacing a file atomically, and checking that other users may reach a directory."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import yaml

from .errors import InvalidArgument


def read_structured(path: str, what: str) -> Any:
    """Parse `path` as JSON (by its .json suffix) or YAML. Raises InvalidArgument naming `what` and `path`."""
    p = Path(path).expanduser()
    try:
        text = p.read_text()
    except OSError as e:
        raise InvalidArgument(f"cannot read {what} {path}: {e.strerror}") from e
    try:
        return json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        raise InvalidArgument(f"{what} {path} is not valid YAML/JSON: {e}") from e


def atomic_write_bytes(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Replace `path` with `data` in one rename: a reader (a server reloading its certificate) sees the old
    file or the new one, never a part. Created with `mode` from the start (a key is never world-readable)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.fchmod(fd, mode)
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def closed_parent(path: Path) -> tuple[Path, int] | None:
    """The first directory above `path` that other users may not pass through (no o+x), with its mode; None
    when they may reach `path` (a directory that workers running as other uids must enter)."""
    for parent in path.parents:
        mode = os.stat(parent).st_mode
        if not mode & stat.S_IXOTH:
            return parent, stat.S_IMODE(mode)
    return None
