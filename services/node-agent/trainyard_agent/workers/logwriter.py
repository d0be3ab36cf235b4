"""Writing one rank's log file: lines tagged with their stream, time and sequence number, bounded and rotated
on write.

The format (read back by `logs.py`): each line is stored as one record,

    <tag> <seq> <time_ms> <bytes the worker wrote>\n

with `tag` `o` stdout, `e` stderr, `a` a note from the agent or the worker's shim; `seq` the line's number
among the rank's lines of the attempt (1, 2, ...), and `time_ms` the wall-clock time it was written (unix
milliseconds), both in decimal. The sequence continues across rotation (the writer counts) and across a
new writer of the same file (the shim restarted, the agent's own note after the shim ended): `RankLog`
takes the next number from the last record of the newest file when it opens. So a reader can resume a
rank exactly ("after seq N") however many of its old files rotation dropped meanwhile.

The format before (still read: an upgraded agent meets files, and shims, of the old one) was
`<TAG> <bytes>\n` with upper-case tags `O`/`E`/`A` and no number or time. `parse_record` reads both;
`Sequencer` numbers an old record one past the record before it (so an old file is numbered by position,
which shifts when rotation drops its oldest file: the one case an exact resume cannot cover), and its time
is unknown (0).

The file is rotated to `.1` … `.N` (`.1` newest) before a record would take it past `max_bytes`, so a
rank never holds more than `max_bytes * (backups + 1)` bytes.

Standard library only: the shim (`shim.py`), one per worker, imports this and must start fast and small.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

# Longest stored line; longer output, or output without any newline, is cut into lines of this size
# instead of growing a buffer without bound.
MAX_LINE_BYTES = 64 * 1024
# The tags of the format before (read only) and of the current one (written).
TAGS = {"stdout": b"O ", "stderr": b"E ", "agent": b"A "}
_NEW_TAGS = {"stdout": b"o", "stderr": b"e", "agent": b"a"}
STREAM_OF_TAG = {**{tag[0]: stream for stream, tag in TAGS.items()},
                 **{tag[0]: stream for stream, tag in _NEW_TAGS.items()}}
_NEW_TAG_BYTES = frozenset(tag[0] for tag in _NEW_TAGS.values())
# Tag and newline around every stored line (the old format's whole overhead).
RECORD_OVERHEAD = 3
# The most the current format adds on top: " <seq> <time_ms> " (19 and 13 digits at most).
HEADER_MAX = 1 + 19 + 1 + 13 + 1


def parse_record(raw: bytes) -> tuple[str, int, int, bytes]:
    """(stream, seq, time_ms, text) of one stored record (without its newline). seq and time_ms are 0 for a
    record of the old format (or one whose header is damaged): `Sequencer` numbers those by position."""
    if raw[:1] and raw[0] in _NEW_TAG_BYTES and raw[1:2] == b" ":
        parts = raw[2:].split(b" ", 2)
        if len(parts) == 3 and parts[0].isdigit() and parts[1].isdigit():
            return STREAM_OF_TAG[raw[0]], int(parts[0]), int(parts[1]), parts[2]
    return STREAM_OF_TAG.get(raw[0], "stdout") if raw else "stdout", 0, 0, raw[2:]


class Sequencer:
    """The seq of each record of one rank read in order, oldest first: its own, or (old format) one past
    the record before it. Records whose number does not move forward (a rotation seen twice by a racing
    reader) are duplicates: `number` returns 0 for them."""

    def __init__(self, last: int = 0) -> None:
        self.last = last

    def number(self, seq: int) -> int:
        if not seq:
            seq = self.last + 1
        elif seq <= self.last:
            return 0
        self.last = seq
        return seq


def rank_files_newest_first(path: Path) -> list[Path]:
    """The files of the rank log at `path` that exist: the current one, then `.1`, `.2`, ... (consecutive)."""
    out = [path] if path.exists() else []
    n = 1
    while (older := path.with_name(f"{path.name}.{n}")).exists():
        out.append(older)
        n += 1
    return out


def records(paths: Iterable[Path]) -> Iterator[bytes]:
    """The stored records of `paths` in order, without their newlines; a file rotated away meanwhile is
    passed over (its records are in the next one)."""
    for path in paths:
        try:
            with open(path, "rb") as f:
                for raw in f:
                    yield raw.rstrip(b"\n")
        except FileNotFoundError:
            continue


def last_seq(path: Path) -> int:
    """The seq of the newest record of the rank log at `path` (0: none). Reads the end of the newest
    non-empty file when its last record has a number (the usual case); counts every retained record when it
    does not (files of the old format)."""
    files = rank_files_newest_first(path)
    for newest in files:
        try:
            with open(newest, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                if not size:
                    continue
                f.seek(max(0, size - (MAX_LINE_BYTES + HEADER_MAX + 2)))
                tail = f.read().rstrip(b"\n").rsplit(b"\n", 1)[-1]
        except FileNotFoundError:
            continue
        _, seq, _, _ = parse_record(tail)
        if seq:
            return seq
        break
    sequencer = Sequencer()
    for raw in records(reversed(files)):
        sequencer.number(parse_record(raw)[1])
    return sequencer.last


class RankLog:
    """Appends one rank's lines to its file, rotating at `max_bytes`. Not thread-safe; one writer per file
    at a time (a later writer of the same file continues its numbering)."""

    def __init__(self, path: Path, *, max_bytes: int, backups: int) -> None:
        if max_bytes <= RECORD_OVERHEAD + HEADER_MAX:
            raise ValueError(f"max_bytes must be larger than {RECORD_OVERHEAD + HEADER_MAX}, got {max_bytes}")
        if backups < 0:
            raise ValueError(f"backups must be >= 0, got {backups}")
        self.path = path
        self._max_bytes = max_bytes
        self._backups = backups
        # Lines are cut to this size so that one line never takes a file past max_bytes on its own.
        self.max_line = min(MAX_LINE_BYTES, max_bytes - RECORD_OVERHEAD - HEADER_MAX)
        self.seq = last_seq(path)
        self._file: BinaryIO = open(path, "ab")  # noqa: SIM115 - closed by close()
        self._size = self._file.tell()
        if self._size and _last_byte(path) != b"\n":
            # A writer died in the middle of a record: end it, so the next one is not glued to it.
            self._file.write(b"\n")
            self._size += 1
        # The last write failed (disk full, I/O error); the writer reports that once, not per line.
        self.failed = False

    def write(self, stream: str, line: bytes) -> None:
        """Store one line (without its newline) of `stream`: "stdout", "stderr" or "agent"."""
        self.seq += 1  # before the write: a record that failed half-way leaves a gap, never a repeat
        record = b"%s %d %d %s\n" % (_NEW_TAGS[stream], self.seq, time.time_ns() // 1_000_000, line)
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


def _last_byte(path: Path) -> bytes:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1)


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
