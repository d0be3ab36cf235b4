"""Per-rank log files: read back (with a tail) or followed while written.

Layout: `<state_dir>/jobs/<job_id>/attempt-<n>/rank-<r>.log`, rotated to `rank-<r>.log.1` … `.N`
(`.1` newest). The worker's shim writes them (`logwriter.RankLog`: each line tagged with its stream, its
sequence number and the time it was written, so the stream of every line survives in one file per rank and
lines of both streams stay in the order the shim read them); the agent only reads, so it reads the logs of
workers of a previous agent life alike, and files of the format before (numbered by position, time unknown).

Selecting (`select`, pure, the same for a read and a follow): a rank's lines after `after_seq[rank]`, of those the
ones written at or after `since_ms`, of those the last `tail_lines`. A line of unknown time (the format before) is
older than every line after it: it is left out when a later line of the rank was written before `since_ms`, and kept
when none shows that (`since` cannot place it). A follow applies the tail once, to what is retained when it first
sees a rank (read to the end of the current file, however large), then sends every new line.
"""

from __future__ import annotations

import os
import re
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from trainyard_core.errors import NotFound

from .logwriter import MAX_LINE_BYTES, LineSplitter, RankLog, Sequencer, parse_record
from .logwriter import records as _records
from .model import LogLine, LogQuery, check_job_id

__all__ = ["MAX_LINE_BYTES", "LineSplitter", "LogFollower", "RankLog", "attempt_dir", "attempt_dirs", "job_dir",
           "numbered", "parse_record", "rank_files", "rank_log_path", "read_logs", "require_job", "select"]

_ATTEMPT_RE = re.compile(r"^attempt-(\d+)$")
_RANK_RE = re.compile(r"^rank-(\d+)\.log(?:\.(\d+))?$")


def job_dir(jobs_root: Path, job_id: str) -> Path:
    check_job_id(job_id)
    return jobs_root / job_id


def attempt_dir(jobs_root: Path, job_id: str, attempt: int) -> Path:
    return job_dir(jobs_root, job_id) / f"attempt-{attempt}"


def rank_log_path(adir: Path, rank: int) -> Path:
    return adir / f"rank-{rank}.log"


def numbered(raws: Iterable[bytes], sequencer: Sequencer, *, attempt: int, rank: int) -> Iterator[LogLine]:
    """The lines of a rank's records read in order, each with its seq (duplicates left out)."""
    for raw in raws:
        stream, seq, time_ms, text = parse_record(raw)
        seq = sequencer.number(seq)
        if seq:
            yield LogLine(rank=rank, stream=stream, text=text.decode(errors="replace"), attempt=attempt, seq=seq,
                          time_ms=time_ms)


def select(lines: Iterable[LogLine], query: LogQuery, rank: int, *, tail: bool = True) -> list[LogLine]:
    """One rank's lines that `query` asks for (see the module's docstring); `tail=False` ignores its tail. Pure."""
    after, since = query.after_seq.get(rank, 0), query.since_ms
    keep: deque[LogLine] | list[LogLine] = deque(maxlen=query.tail_lines) if tail and query.tail_lines else []
    untimed: list[LogLine] = []  # lines of unknown time since the last timed one, until a timed one places them
    for line in lines:
        if line.seq <= after:
            continue
        if not since:
            keep.append(line)
        elif not line.time_ms:
            untimed.append(line)
        else:
            if line.time_ms >= since:
                keep.extend(untimed)  # written before this line: maybe at or after `since`, so kept
                keep.append(line)
            untimed.clear()  # otherwise written before a line older than `since`: older too
    keep.extend(untimed)
    return list(keep)


# --- reading -----------------------------------------------------------------------------------------


def attempt_dirs(jobs_root: Path, job_id: str, attempt: int = 0) -> list[tuple[int, Path]]:
    """(attempt, dir) of a job on this node, oldest attempt first; only `attempt` unless it is 0."""
    jdir = job_dir(jobs_root, job_id)
    if not jdir.is_dir():
        return []
    found = []
    for entry in jdir.iterdir():
        m = _ATTEMPT_RE.match(entry.name)
        if m and entry.is_dir() and (attempt == 0 or int(m.group(1)) == attempt):
            found.append((int(m.group(1)), entry))
    return sorted(found)


def rank_files(adir: Path) -> dict[int, list[Path]]:
    """rank → its files, oldest first (`.N` … `.1`, then the current one)."""
    by_rank: dict[int, list[tuple[int, Path]]] = {}
    for entry in adir.iterdir():
        m = _RANK_RE.match(entry.name)
        if m:
            generation = int(m.group(2) or 0)
            by_rank.setdefault(int(m.group(1)), []).append((generation, entry))
    return {rank: [p for _, p in sorted(files, key=lambda t: -t[0])] for rank, files in sorted(by_rank.items())}


def require_job(jobs_root: Path, query: LogQuery) -> list[tuple[int, Path]]:
    """The job's attempt directories; NotFound when this node never ran it (or not that attempt)."""
    dirs = attempt_dirs(jobs_root, query.job_id, query.attempt)
    if not dirs:
        which = f"attempt {query.attempt} of job" if query.attempt else "job"
        raise NotFound(f"{which} {query.job_id} has no workers on this node")
    return dirs


def read_logs(jobs_root: Path, query: LogQuery, *, max_bytes: int) -> list[LogLine]:
    """Retained lines of a job on this node, attempt by attempt and rank by rank.

    Raises NotFound when this node never ran the job. When the lines exceed `max_bytes` (a gRPC
    message has a size limit), the oldest lines of each rank are dropped and one line says so.
    """
    dirs = require_job(jobs_root, query)
    groups: list[tuple[int, int, list[LogLine]]] = []
    for attempt, adir in dirs:
        for rank, paths in rank_files(adir).items():
            records = numbered(_records(paths), Sequencer(), attempt=attempt, rank=rank)
            groups.append((attempt, rank, select(records, query, rank)))
    total = sum(len(line.text) + 16 for *_, lines in groups for line in lines)
    out: list[LogLine] = []
    budget = max_bytes // max(1, len(groups))
    for attempt, rank, lines in groups:
        if total > max_bytes:
            lines, dropped = _trim(lines, budget)
            if dropped:
                out.append(LogLine(rank=rank, stream="agent", attempt=attempt,
                                   text=f"[{dropped} earlier lines not shown: the answer is limited to "
                                        f"{max_bytes // (1024 * 1024)} MiB; ask for tail_lines or stream]"))
        out.extend(lines)
    return out


def _trim(lines: list[LogLine], budget: int) -> tuple[list[LogLine], int]:
    used = 0
    start = len(lines)
    while start > 0 and used + len(lines[start - 1].text) + 16 <= budget:
        start -= 1
        used += len(lines[start].text) + 16
    return lines[start:], start


# --- following ---------------------------------------------------------------------------------------


@dataclass
class _Cursor:
    """Reads one rank's current file from where it left off and moves to the new file after a rotation."""

    path: Path
    sequencer: Sequencer = field(default_factory=Sequencer)
    file: BinaryIO | None = None
    inode: int = -1
    partial: bytes = b""

    def read_new(self, limit: int) -> tuple[list[bytes], bool]:
        """Complete lines written since the last call (about `limit` bytes at most); True if more wait."""
        out: list[bytes] = []
        for _ in range(3):  # a few rotations per poll at most; a faster writer loses lines, not the stream
            if self.file is None:
                try:
                    self.file = open(self.path, "rb")  # noqa: SIM115 - closed in close()
                except FileNotFoundError:
                    return out, False
                self.inode = os.fstat(self.file.fileno()).st_ino
            chunk = self.file.read(limit)
            lines = (self.partial + chunk).split(b"\n")
            self.partial = lines.pop()
            out.extend(lines)
            if len(chunk) == limit:
                return out, True
            try:
                rotated = os.stat(self.path).st_ino != self.inode
            except FileNotFoundError:
                rotated = True
            if not rotated:
                return out, False
            # Our handle holds the rotated-away file, now read to its end: continue with the new file.
            self.close()
        return out, False

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        self.partial = b""


# Reads of `read_limit` at a rank's first sight at most (1 GiB by default, far above a rank's retained bytes):
# a writer faster than the reader cannot keep the first poll going for ever.
_FIRST_READS = 1024


@dataclass
class LogFollower:
    """Yields a job's lines as they are written: first what is retained, then what follows.

    New attempt directories and ranks that appear while following are picked up. It reads files only,
    so it works for workers of a previous agent life too. `more` is True after a poll that left unread
    bytes behind (the caller polls again at once instead of waiting for a change).
    """

    jobs_root: Path
    query: LogQuery
    read_limit: int = 1024 * 1024
    more: bool = False
    _cursors: dict[tuple[int, int], _Cursor] = field(default_factory=dict)

    def poll(self) -> list[LogLine]:
        out: list[LogLine] = []
        self.more = False
        for attempt, adir in attempt_dirs(self.jobs_root, self.query.job_id, self.query.attempt):
            for rank, paths in rank_files(adir).items():
                key = (attempt, rank)
                cursor = self._cursors.get(key)
                first = cursor is None
                if cursor is None:
                    # First sight of this rank: its rotated files are history, then follow the current one,
                    # read to its end now so that a tail is the tail of everything retained.
                    cursor = self._cursors[key] = _Cursor(rank_log_path(adir, rank))
                    records = list(_records(p for p in paths if p != cursor.path))
                    more = True
                    for _ in range(_FIRST_READS):
                        if not more:
                            break
                        new, more = cursor.read_new(self.read_limit)
                        records.extend(new)
                else:
                    records, more = cursor.read_new(self.read_limit)
                self.more = self.more or more
                lines = numbered(records, cursor.sequencer, attempt=attempt, rank=rank)
                out.extend(select(lines, self.query, rank, tail=first))
        return out

    def close(self) -> None:
        for cursor in self._cursors.values():
            cursor.close()
        self._cursors.clear()
