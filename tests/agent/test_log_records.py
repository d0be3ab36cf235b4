"""The rank log's records: each line's time and per-rank sequence number, kept across rotation and across a
new writer of the same file, files of the old format still read, and the selection by `since` / `after_seq` /
tail of a read, a follow and the agent's gRPC answer."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import grpc
import grpc.aio
import pytest

from tests.agent.agent_kit import Scheduler, agent_settings
from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard.common.v1 import types_pb2
from trainyard_agent.app import AgentApp
from trainyard_agent.grpc import convert
from trainyard_agent.workers import logs, logwriter
from trainyard_agent.workers.model import LogLine, LogQuery
from trainyard_core.errors import InvalidArgument

PY = sys.executable


def adir_of(tmp_path: Path, attempt: int = 1) -> Path:
    adir = tmp_path / "jobs" / "j1" / f"attempt-{attempt}"
    adir.mkdir(parents=True, exist_ok=True)
    return adir


def writer(adir: Path, *, max_bytes: int = 1 << 20, backups: int = 2, rank: int = 0) -> logwriter.RankLog:
    return logwriter.RankLog(logs.rank_log_path(adir, rank), max_bytes=max_bytes, backups=backups)


def read(tmp_path: Path, **query: object) -> list[LogLine]:
    return logs.read_logs(tmp_path / "jobs", LogQuery("j1", **query), max_bytes=1 << 20)  # type: ignore[arg-type]


def test_a_record_holds_stream_seq_time_and_text(tmp_path: Path) -> None:
    adir = adir_of(tmp_path)
    before = time.time_ns() // 1_000_000
    rl = writer(adir)
    rl.write("stdout", b"hello world")
    rl.write("stderr", b"")
    rl.write("agent", b"a note")
    rl.close()
    after = time.time_ns() // 1_000_000
    raw = logs.rank_log_path(adir, 0).read_bytes().split(b"\n")
    assert raw[-1] == b"" and len(raw) == 4
    parsed = [logwriter.parse_record(r) for r in raw[:3]]
    assert [(s, q, t) for s, q, _, t in parsed] == [("stdout", 1, b"hello world"), ("stderr", 2, b""),
                                                    ("agent", 3, b"a note")]
    assert all(before <= ms <= after for _, _, ms, _ in parsed)
    lines = read(tmp_path)
    assert [(ln.stream, ln.seq, ln.text) for ln in lines] == [("stdout", 1, "hello world"), ("stderr", 2, ""),
                                                              ("agent", 3, "a note")]
    assert [ln.time_ms for ln in lines] == [ms for _, _, ms, _ in parsed]


def test_rotation_keeps_the_sequence_going(tmp_path: Path) -> None:
    adir = adir_of(tmp_path)
    rl = writer(adir, max_bytes=4096, backups=2)
    for i in range(1000):
        rl.write("stdout", f"line {i:04d}".encode())
    rl.close()
    lines = read(tmp_path)
    # The oldest files were dropped; what is left is numbered as written, without a gap, up to the last line.
    seqs = [ln.seq for ln in lines]
    assert seqs == list(range(1001 - len(seqs), 1001)) and 100 < len(seqs) < 1000
    assert all(ln.text == f"line {ln.seq - 1:04d}" for ln in lines)


def test_a_new_writer_continues_the_sequence(tmp_path: Path) -> None:
    adir = adir_of(tmp_path)
    path = logs.rank_log_path(adir, 0)
    rl = writer(adir)
    for i in range(5):
        rl.write("stdout", f"{i}".encode())
    rl.close()
    # The shim restarted (or the agent notes the worker's end after its shim ended): the same file, next seq.
    rl = writer(adir)
    rl.write("agent", b"[exit status unknown]")
    rl.close()
    # A writer that died in the middle of a record: the next one ends that record instead of gluing to it.
    with open(path, "ab") as f:
        f.write(b"o 7 1700000000000 half a li")
    rl = writer(adir)
    rl.write("stdout", b"after the crash")
    rl.close()
    # Rotated just before a restart, the current file not written yet: the number comes from `.1`.
    os.replace(path, path.with_name(path.name + ".1"))
    path.touch()
    rl = writer(adir)
    rl.write("stdout", b"after the rotation")
    rl.close()
    assert [(ln.seq, ln.text) for ln in read(tmp_path)] == [
        (1, "0"), (2, "1"), (3, "2"), (4, "3"), (5, "4"), (6, "[exit status unknown]"), (7, "half a li"),
        (8, "after the crash"), (9, "after the rotation")]


def test_files_of_the_old_format_are_read_and_continued(tmp_path: Path) -> None:
    adir = adir_of(tmp_path)
    path = logs.rank_log_path(adir, 0)
    path.with_name(path.name + ".1").write_bytes(b"O first\nE second\n")
    path.write_bytes(b"O third\nA a note\n")
    lines = read(tmp_path)
    assert [(ln.seq, ln.stream, ln.text, ln.time_ms) for ln in lines] == [
        (1, "stdout", "first", 0), (2, "stderr", "second", 0), (3, "stdout", "third", 0), (4, "agent", "a note", 0)]
    # An upgraded shim writing on after an old one: numbered on from the old lines' positions.
    rl = writer(adir)
    rl.write("stdout", b"new")
    rl.close()
    assert [(ln.seq, ln.text) for ln in read(tmp_path)][-2:] == [(4, "a note"), (5, "new")]
    assert read(tmp_path)[-1].time_ms > 0


def test_since_after_seq_and_tail_select_lines(tmp_path: Path) -> None:
    adir = adir_of(tmp_path)
    # Written by hand to set the times: an old-format line (time unknown) then five timed ones.
    logs.rank_log_path(adir, 0).write_bytes(
        b"O old\n" + b"".join(b"o %d %d t%d\n" % (seq, 1000 * seq, seq) for seq in range(2, 7)))
    logs.rank_log_path(adir, 1).write_bytes(b"".join(b"e %d %d u%d\n" % (seq, 1000 * seq, seq)
                                                     for seq in range(1, 4)))

    def texts(**query: object) -> list[str]:
        return [f"{ln.rank}:{ln.text}" for ln in read(tmp_path, **query)]

    # since: lines at or after. The line of unknown time is older than t2 (2 s): left out when t2 is before
    # `since`, kept when it is not (it may be at or after `since`).
    assert texts(since_ms=4000) == ["0:t4", "0:t5", "0:t6"]
    assert texts(since_ms=1500) == ["0:old", "0:t2", "0:t3", "0:t4", "0:t5", "0:t6", "1:u2", "1:u3"]
    # after_seq is per rank; a rank not named starts from its first line.
    assert texts(attempt=1, after_seq={0: 4}) == ["0:t5", "0:t6", "1:u1", "1:u2", "1:u3"]
    assert texts(attempt=1, after_seq={0: 6, 1: 2}) == ["1:u3"]
    # The tail is of the selected lines.
    assert texts(since_ms=2000, tail_lines=2) == ["0:t5", "0:t6", "1:u2", "1:u3"]
    # All three: the old line is before seq 2, rank 1's lines before the time.
    assert texts(attempt=1, after_seq={0: 2}, since_ms=5000, tail_lines=10) == ["0:t5", "0:t6"]


def test_since_keeps_lines_of_unknown_time_only_where_no_later_line_places_them_before_it(tmp_path: Path) -> None:
    adir = adir_of(tmp_path)
    # Rank 0: a file of the format before only (no time anywhere). Rank 1: two old lines, then timed ones.
    logs.rank_log_path(adir, 0).write_bytes(b"O a\nE b\n")
    logs.rank_log_path(adir, 1).write_bytes(b"O c\nO d\n" + b"o 3 3000 t3\no 4 9000 t9\n")

    def texts(**query: object) -> list[str]:
        return [f"{ln.rank}:{ln.text}" for ln in read(tmp_path, **query)]

    assert texts(since_ms=5000) == ["0:a", "0:b", "1:t9"]  # nothing places rank 0's; rank 1's predate 3 s
    assert texts(since_ms=3000) == ["0:a", "0:b", "1:c", "1:d", "1:t3", "1:t9"]
    assert texts(since_ms=5000, tail_lines=1) == ["0:b", "1:t9"]


def test_a_follow_with_a_tail_takes_the_tail_of_everything_retained(tmp_path: Path) -> None:
    adir = adir_of(tmp_path)
    rl = writer(adir, max_bytes=1 << 20, backups=2)
    for i in range(100):
        rl.write("stdout", f"line {i:03d}".encode())
    rl.flush()
    # A read limit far below the current file's size: the tail must still be the last three lines, not the
    # last three of the first read (the lines after it then came untrimmed).
    follower = logs.LogFollower(tmp_path / "jobs", LogQuery("j1", tail_lines=3), read_limit=64)
    assert [(ln.seq, ln.text) for ln in follower.poll()] == [(98, "line 097"), (99, "line 098"), (100, "line 099")]
    assert follower.poll() == []
    rl.write("stdout", b"new")
    rl.flush()
    assert [(ln.seq, ln.text) for ln in follower.poll()] == [(101, "new")]
    rl.close()
    follower.close()


def test_a_follow_resumes_after_a_seq_across_a_dropped_file(tmp_path: Path) -> None:
    adir = adir_of(tmp_path)
    rl = writer(adir, max_bytes=4096, backups=1)
    for i in range(50):
        rl.write("stdout", f"{i:03d}".encode() + b"-" * 60)
    rl.flush()
    seen = read(tmp_path)[-1].seq
    assert seen == 50
    for i in range(50, 200):  # several rotations: the file that held line 50 is gone
        rl.write("stdout", f"{i:03d}".encode() + b"-" * 60)
    rl.flush()
    assert read(tmp_path)[0].seq > seen + 1, "rotation should have dropped lines after the resume point"
    follower = logs.LogFollower(tmp_path / "jobs", LogQuery("j1", attempt=1, after_seq={0: 190}))
    assert [ln.seq for ln in follower.poll()] == list(range(191, 201))
    rl.close()
    follower.close()


@pytest.mark.parametrize(("fields", "named"), [
    ({"job_id": ""}, "job_id"),
    ({"attempt": -1}, "attempt"),
    ({"tail_lines": -1}, "tail_lines"),
    ({"since_unix_ms": -5}, "since_unix_ms"),
    ({"after_seq": {0: 3}}, "after_seq needs attempt"),
    ({"attempt": 1, "after_seq": {-1: 3}}, "after_seq"),
    ({"attempt": 1, "after_seq": {0: -3}}, "after_seq"),
])
def test_bad_log_requests_name_the_field(fields: dict[str, object], named: str) -> None:
    request = agent_pb2.GetWorkerLogsRequest(**{"job_id": "j1", **fields})  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=named):
        convert.log_query_from_pb(request)


async def test_the_agent_answers_lines_with_seq_and_time_and_selects_by_them(tmp_path: Path,
                                                                             scheduler: Scheduler) -> None:
    app = AgentApp(agent_settings(tmp_path / "state", scheduler.address))
    await app.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            await scheduler.registered()
            start_ms = time.time_ns() // 1_000_000
            job_id = await scheduler.submit([PY, "-c", "for i in range(5): print(f'line {i}', flush=True)"])
            await scheduler.job_in(job_id, types_pb2.JOB_STATE_SUCCEEDED, timeout=30)
            every = await stub.GetWorkerLogs(agent_pb2.GetWorkerLogsRequest(job_id=job_id), timeout=10)
            printed = [ln for ln in every.lines if ln.stream == "stdout"]
            assert [ln.text for ln in printed] == [f"line {i}" for i in range(5)]
            assert [ln.seq for ln in every.lines] == list(range(1, len(every.lines) + 1))
            assert all(ln.time_unix_ms >= start_ms for ln in every.lines)

            third = printed[2].seq
            request = agent_pb2.GetWorkerLogsRequest(job_id=job_id, attempt=1, after_seq={0: third})
            after = await stub.GetWorkerLogs(request, timeout=10)
            assert [ln.seq for ln in after.lines] == [ln.seq for ln in every.lines if ln.seq > third]
            streamed = [ln async for chunk in stub.StreamWorkerLogs(request, timeout=10) for ln in chunk.lines]
            assert [ln.seq for ln in streamed] == [ln.seq for ln in after.lines]
            later = await stub.GetWorkerLogs(agent_pb2.GetWorkerLogsRequest(
                job_id=job_id, since_unix_ms=every.lines[-1].time_unix_ms + 1), timeout=10)
            assert list(later.lines) == []

            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await stub.GetWorkerLogs(agent_pb2.GetWorkerLogsRequest(job_id=job_id, after_seq={0: 1}), timeout=10)
            assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "after_seq" in (failed.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                async for _ in stub.StreamWorkerLogs(agent_pb2.GetWorkerLogsRequest(job_id=job_id, since_unix_ms=-1),
                                                     timeout=10):
                    pass
            assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "since_unix_ms" in (failed.value.details() or "")
    finally:
        await app.stop(kill_workers=True)
