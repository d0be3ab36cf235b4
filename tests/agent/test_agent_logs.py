"""Rank log files: rotation bounds, line splitting, reading with tails and following across rotations; and a
worker that floods its output through a real agent."""

from __future__ import annotations

import asyncio
import sys
import textwrap
import time
from pathlib import Path

import grpc
import grpc.aio

from tests.agent.agent_kit import Scheduler, agent_settings
from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard.common.v1 import types_pb2
from trainyard_agent.app import AgentApp
from trainyard_agent.workers import logs
from trainyard_agent.workers.model import LogQuery, Stream

PY = sys.executable


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


def test_lines_are_cut_to_fit_a_small_file(tmp_path: Path) -> None:
    # A line longer than a whole file would take its file past max_bytes: it is cut to fit instead.
    adir = tmp_path / "jobs" / "j1" / "attempt-1"
    adir.mkdir(parents=True)
    rl = logs.RankLog(logs.rank_log_path(adir, 0), max_bytes=4096, backups=3)
    splitter = logs.LineSplitter(rl.max_line)
    for line in splitter.feed(b"z" * 10_000 + b"\nend"):
        rl.write(Stream.STDOUT, line)
    for line in splitter.finish():
        rl.write(Stream.STDOUT, line)
    rl.close()
    assert all(p.stat().st_size <= 4096 for p in adir.iterdir())
    texts = [ln.text for ln in logs.read_logs(tmp_path / "jobs", LogQuery("j1"), max_bytes=1 << 20)]
    assert "".join(texts[:-1]) == "z" * 10_000 and texts[-1] == "end"


def test_agent_notes_keep_their_stream(tmp_path: Path) -> None:
    adir = tmp_path / "jobs" / "j1" / "attempt-1"
    write(adir, 0, [(Stream.STDOUT, "out")]).close()
    rl = logs.RankLog(logs.rank_log_path(adir, 0), max_bytes=1 << 20, backups=0)
    rl.write("agent", b"[a note]")
    rl.close()
    lines = logs.read_logs(tmp_path / "jobs", LogQuery("j1"), max_bytes=1 << 20)
    assert [(ln.stream, ln.text) for ln in lines] == [("stdout", "out"), ("agent", "[a note]")]


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


# 1,000,000 numbered lines of 100 bytes (100 MB) in 1 MB writes, then "flood done"; then it waits for the
# file given as argument (two minutes at most) and exits.
FLOOD = textwrap.dedent("""
    import pathlib, sys, time
    out = sys.stdout.buffer
    for block in range(100):
        out.write(b"".join(b"%09d %s\\n" % (block * 10000 + i, b"x" * 89) for i in range(10000)))
    out.write(b"flood done\\n")
    out.flush()
    deadline = time.monotonic() + 120
    while not pathlib.Path(sys.argv[1]).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
""")


async def test_a_worker_printing_100_mb_keeps_the_newest_lines_within_bounds(tmp_path: Path,
                                                                            scheduler: Scheduler) -> None:
    max_bytes, backups = 1 << 20, 2
    app = AgentApp(agent_settings(tmp_path / "state", scheduler.address, log_max_bytes=max_bytes,
                                  log_backups=backups))
    await app.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            await scheduler.registered()
            go = tmp_path / "go"
            job_id = await scheduler.submit([PY, "-c", FLOOD, str(go)])
            await scheduler.job_in(job_id, types_pb2.JOB_STATE_RUNNING)

            # While the flood runs, the agent answers (its gRPC calls have deadlines: a stalled agent fails them).
            deadline = time.monotonic() + 120
            while True:
                listed = await stub.ListWorkers(agent_pb2.ListWorkersRequest(), timeout=10)
                assert [(w.job_id, w.running) for w in listed.workers] == [(job_id, True)]
                tail = await stub.GetWorkerLogs(agent_pb2.GetWorkerLogsRequest(job_id=job_id, tail_lines=1),
                                                timeout=10)
                if [ln.text for ln in tail.lines] == ["flood done"]:
                    break
                assert time.monotonic() < deadline, "the flood did not reach the log within two minutes"
                await asyncio.sleep(0.05)

            assert app.supervisor is not None
            adir = app.supervisor.jobs_root / job_id / "attempt-1"
            files = sorted(p for p in adir.iterdir() if p.name.startswith("rank-0.log"))
            assert [p.name for p in files] == ["rank-0.log", "rank-0.log.1", "rank-0.log.2"]
            assert all(p.stat().st_size <= max_bytes for p in files)
            assert sum(p.stat().st_size for p in files) <= max_bytes * (backups + 1)

            every = await stub.GetWorkerLogs(agent_pb2.GetWorkerLogsRequest(job_id=job_id), timeout=30)
            texts = [ln.text for ln in every.lines]
            assert texts[-1] == "flood done"
            numbers = [int(t.split()[0]) for t in texts[:-1]]
            # The newest lines, in order and without a gap; the oldest were rotated away. At least the two full
            # rotated files' worth is kept (a record is the 100 bytes plus its tag, seq and time: < 130 bytes).
            assert numbers == list(range(1_000_000 - len(numbers), 1_000_000))
            assert len(numbers) > 2 * max_bytes // 130
            assert all(t.endswith(" " + "x" * 89) for t in texts[:-1])

            go.touch()
            await scheduler.job_in(job_id, types_pb2.JOB_STATE_SUCCEEDED, timeout=30)
    except grpc.aio.AioRpcError as exc:
        raise AssertionError(f"the agent did not answer: {exc.code()} {exc.details()}") from exc
    finally:
        await app.stop(kill_workers=True)
