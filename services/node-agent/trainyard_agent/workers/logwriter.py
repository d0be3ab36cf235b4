"""Writing one rank's log file: lines tagged with their stream, bounded and rotated on write.

The format (read back by `logs.py`): each line is stored as a 2-byte tag (`O ` stdout, `E ` stderr, `A `
a note from the agent or the worker's shim) followed by the bytes the worker wrote and a newline. The
file is rotated to `.1` … `.N` (`.1` newest) before a line would take it past `max_bytes`, so a rank
never holds more than `max_bytes * (backups + 1)` bytes.

Standard library only: the shim (`shim.py`), one per worker, imports this and must start fast and small.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

# Longest stored line; longer output, or output without any newline, is cut into lines of this size
# instead of growing a buffer without bound.
MAX_LINE_BYTES = 64 * 1024
TAGS = {"stdout": b"O ", "stderr": b"E ", "agent": b"A "}
# Tag and newline around every stored line.
RECORD_OVERHEAD = 3


class RankLog:
    """Appends one rank's lines to its file, rotating at `max_bytes`. Not thread-safe; one writer per file."""

    def __init__(self, path: Path, *, max_bytes: int, backups: int) -> None:
        if max_bytes <= RECORD_OVERHEAD:
            raise ValueError(f"max_bytes must be larger than {RECORD_OVERHEAD}, got {max_bytes}")
        if backups < 0:
            raise ValueError(f"backups must be >= 0, got {backups}")
        self.path = path
        self._max_bytes = max_bytes
        self._backups = backups
        # Lines are cut to this size so that one line never takes a file past max_bytes on its own.
        self.max_line = min(MAX_LINE_BYTES, max_bytes - RECORD_OVERHEAD)
        self._file: BinaryIO = open(path, "ab")  # noqa: SIM115 - closed by close()
        self._size = self._file.tell()
        # The last write failed (disk full, I/O error); the writer reports that once, not per line.
        self.failed = False

    def write(self, stream: str, line: bytes) -> None:
        """Store one line (without its newline) of `stream`: "stdout", "stderr" or "agent"."""
        record = TAGS[stream] + line + b"\n"
        if self._size and self._size + len(record) > self._max_bytes:
            self._rotate()
        self._file.write(record)
        self._size += len(record)

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def _rotate(self) -> None:
        self._file.close()
        try:
            for n in range(self._backups - 1, 0, -1):
                older = self.path.with_name(f"{self.path.name}.{n}")
                if older.exists():
                    os.replace(older, self.path.with_name(f"{self.path.name}.{n + 1}"))
            if self._backups:
                os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        finally:
            # Always end with an open file; without backups the file starts over. If a rename failed, the
            # next write tries the rotation again.
            self._file = open(self.path, "ab" if self._backups else "wb")  # noqa: SIM115
            self._size = self._file.tell()


class LineSplitter:
    """Turns a stream's chunks into lines; holds an unterminated tail until its newline or `finish()`."""

    def __init__(self, max_line: int = MAX_LINE_BYTES) -> None:
        if max_line < 1:
            raise ValueError(f"max_line must be >= 1, got {max_line}")
        self._max_line = max_line
        self._pending = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        data = self._pending + chunk
        lines = data.split(b"\n")
        self._pending = lines.pop()
        out: list[bytes] = []
        for line in lines:
            out.extend(self._cut(line))
        while len(self._pending) >= self._max_line:
            out.append(self._pending[:self._max_line])
            self._pending = self._pending[self._max_line:]
        return out

    def finish(self) -> list[bytes]:
        """The unterminated tail, if any: a last line without a newline is kept, not dropped."""
        rest, self._pending = self._pending, b""
        return list(self._cut(rest)) if rest else []

    def _cut(self, line: bytes) -> Iterator[bytes]:
        if len(line) <= self._max_line:
            yield line
            return
        for i in range(0, len(line), self._max_line):
            yield line[i:i + self._max_line]
