"""Rank log files: rotation bounds, line splitting, reading with tails and following across rotations."""

from __future__ import annotations

from pathlib import Path

from trainyard_agent.workers import logs
from trainyard_agent.workers.model import LogQuery, Stream


def write(adir: Path, rank: int, lines: list[tuple[Stream, str]], *, max_bytes: int = 1 << 20,
          backups: int = 2) -> logs.RankLog:
    adir.mkdir(parents=True, exist_ok=True)
    rl = logs.RankLog(logs.rank_log_path(adir, rank), max_bytes=max_bytes, backups=backups)
    for stream, text in lines:
        rl.write(stream, text.encode())
    rl.flush()
    return rl


def test_rotation_keeps_files_bounded(tmp_path: Path) -> None:
    adir = tmp_path / "jobs" / "j1" / "attempt-1"
    rl = write(adir, 0, [(Stream.STDOUT, f"line {i:04d}") for i in range(1000)], max_bytes=4096, backups=2)
    rl.close()
    files = sorted(p.name for p in adir.iterdir())
    assert files == ["rank-0.log", "rank-0.log.1", "rank-0.log.2"]
    assert all((adir / f).stat().st_size <= 4096 for f in files)
    lines = logs.read_logs(tmp_path / "jobs", LogQuery("j1"), max_bytes=1 << 20)
    texts = [ln.text for ln in lines]
    # The newest lines survive, in order, without gaps.
    assert texts[-1] == "line 0999" and texts == [f"line {i:04d}" for i in range(1000 - len(texts), 1000)]


def test_without_backups_the_file_starts_over(tmp_path: Path) -> None:
    adir = tmp_path / "jobs" / "j1" / "attempt-1"
    write(adir, 0, [(Stream.STDOUT, "x" * 100)] * 100, max_bytes=4096, backups=0).close()
    assert [p.name for p in adir.iterdir()] == ["rank-0.log"]
    assert (adir / "rank-0.log").stat().st_size <= 4096


def test_splitter_cuts_long_lines_and_keeps_partial_ones() -> None:
    s = logs.LineSplitter()
    assert s.feed(b"a\nb") == [b"a"]
    assert s.feed(b"c\n") == [b"bc"]
    big = s.feed(b"y" * (logs.MAX_LINE_BYTES * 2 + 5))
    assert big == [b"y" * logs.MAX_LINE_BYTES] * 2
    assert s.finish() == [b"yyyyy"] and s.finish() == []


def test_read_all_attempts_with_streams_and_tail(tmp_path: Path) -> None:
    root = tmp_path / "jobs"
    write(root / "j1" / "attempt-1", 0, [(Stream.STDOUT, "a1"), (Stream.STDERR, "a1 err")]).close()
    write(root / "j1" / "attempt-2", 0, [(Stream.STDOUT, "b1"), (Stream.STDOUT, "b2")]).close()
    write(root / "j1" / "attempt-2", 1, [(Stream.STDERR, "r1")]).close()
    every = logs.read_logs(root, LogQuery("j1"), max_bytes=1 << 20)
    assert [(ln.attempt, ln.rank, ln.stream, ln.text) for ln in every] == [
        (1, 0, "stdout", "a1"), (1, 0, "stderr", "a1 err"), (2, 0, "stdout", "b1"), (2, 0, "stdout", "b2"),
        (2, 1, "stderr", "r1")]
    tail = logs.read_logs(root, LogQuery("j1", attempt=2, tail_lines=1), max_bytes=1 << 20)
    assert [(ln.rank, ln.text) for ln in tail] == [(0, "b2"), (1, "r1")]


def test_an_oversized_answer_keeps_the_newest_lines_and_says_so(tmp_path: Path) -> None:
    root = tmp_path / "jobs"
    write(root / "j1" / "attempt-1", 0, [(Stream.STDOUT, f"{i:05d}" + "z" * 100) for i in range(1000)]).close()
    lines = logs.read_logs(root, LogQuery("j1"), max_bytes=10_000)
    assert lines[0].stream == "agent" and "earlier lines not shown" in lines[0].text
    assert lines[-1].text.startswith("00999") and 50 < len(lines) < 120


def test_follower_reads_across_rotations(tmp_path: Path) -> None:
    root = tmp_path / "jobs"
    adir = root / "j1" / "attempt-1"
    rl = write(adir, 0, [(Stream.STDOUT, "first")], max_bytes=4096, backups=3)
    follower = logs.LogFollower(root, LogQuery("j1"))
    assert [ln.text for ln in follower.poll()] == ["first"]
    assert follower.poll() == []
    for i in range(60):  # about 1.5 files: one rotation between polls
        rl.write(Stream.STDERR, f"{i:02d}".encode() + b"-" * 60)
    rl.flush()
    got = follower.poll()
    assert [ln.text[:2] for ln in got] == [f"{i:02d}" for i in range(60)]
    assert {ln.stream for ln in got} == {"stderr"}
    rl.close()
    follower.close()
