"""The real CLI following jobs through the gateway's streams, against a real gateway, scheduler and agents on
simulated GPUs running real worker processes: `submit --follow` to the job's end and its exit code, `logs
-f` across a dropped connection (a TCP forwarder in front of the gateway cuts it mid-stream) without a line
twice or missing, and an earlier attempt's logs from the node it ran on after the job restarted on another.

The workers wait on files the test creates, so each step happens when the test says, never after a sleep."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.gateway.support import Cluster, RunningGateway, python, wait_for_file
from trainyard.common.v1 import types_pb2
from trainyard_core.testing.wait import eventually


class CuttingForwarder:
    """A TCP forwarder on a free loopback port in front of the gateway. `cut()` aborts every connection open
    now, both ways, as a broken network would; new connections are forwarded as before. It counts the line
    events it forwarded to clients and keeps what each connection's request said."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.lines_forwarded = 0
        self.requests: list[bytes] = []
        self._open: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> CuttingForwarder:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()
        self.cut()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cut(self) -> None:
        for writer in list(self._open):
            writer.transport.abort()
        self._open.clear()

    def refuse(self) -> None:
        """Stop listening (a new connection is refused) and cut every open one: the gateway gone for good."""
        assert self._server is not None
        self._server.close()
        self.cut()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._open |= {writer, up_writer}
        index = len(self.requests)
        self.requests.append(b"")

        async def upstream() -> None:
            while data := await reader.read(65536):
                self.requests[index] += data
                up_writer.write(data)
                await up_writer.drain()

        async def downstream() -> None:
            while data := await up_reader.read(65536):
                self.lines_forwarded += data.count(b"event: line\n")
                writer.write(data)
                await writer.drain()

        try:
            await asyncio.gather(upstream(), downstream())
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            for w in (writer, up_writer):
                w.transport.abort()
            self._open -= {writer, up_writer}
            self._tasks.discard(task)


@pytest.fixture
async def forwarder(gateway: RunningGateway) -> AsyncIterator[CuttingForwarder]:
    async with CuttingForwarder(gateway.app.http_port) as f:
        yield f


PHASES = """
    import os, pathlib, sys, time
    rank = int(os.environ["RANK"])

    def phase(n, go=None):
        if go is not None:
            deadline = time.monotonic() + 60
            while not pathlib.Path(go).exists():
                time.sleep(0.02)
                if time.monotonic() > deadline:
                    sys.exit(9)
        for i in range(5):
            print(f"r{rank} phase{n} line{i}")
"""


def lines_of(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("[rank ")]


async def test_submit_follow_prints_the_logs_to_the_end_with_the_jobs_exit_code(
        cli: Any, gateway: RunningGateway, scheduler: Cluster) -> None:
    await scheduler.add_agent("node-a")
    r = await cli("submit", "--follow", "--name", "hello", "--gpus-per-node", "2", "--",
                  *python("import os; print('hello from', os.environ['RANK'])"))
    assert r.rc == 0, r.err
    assert r.out.startswith("submitted job ")
    assert sorted(lines_of(r.out)) == ["[rank 0] hello from 0", "[rank 1] hello from 1"]
    assert "succeeded" in r.err
    r = await cli("submit", "--follow", "--name", "fails", "--", *python("print('bye'); raise SystemExit(7)"))
    assert r.rc == 3, r.err
    assert lines_of(r.out) == ["[rank 0] bye"] and "failed (exit code 7)" in r.err
    r = await cli("submit", "--follow", "--json", "--name", "x", "--", "true")
    assert r.rc == 2 and "--follow" in r.err


async def test_submit_follow_of_a_cancelled_job_exits_4(cli: Any, gateway: RunningGateway, scheduler: Cluster,
                                                        tmp_path: Path) -> None:
    await scheduler.add_agent("node-a")
    follow = asyncio.create_task(cli("submit", "--follow", "--name", "sleeper", "--",
                                     *python("print('started', flush=True)", wait_for_file(tmp_path / "never"))))

    async def streaming() -> str:
        streams = scheduler.agent_calls["node-a"].stream_requests("StreamWorkerLogs")
        return str(streams[0].job_id) if streams else ""

    job_id = await eventually(streaming, timeout=30, what="submit --follow to stream the job's logs")
    async with gateway.client(gateway.admin_token) as http:
        async def printed() -> bool:
            return "started" in (await http.get(f"/v1/jobs/{job_id}/logs")).text

        await eventually(printed, what="the worker's first line")
        assert (await http.post(f"/v1/jobs/{job_id}:cancel")).status_code == 200
    r = await asyncio.wait_for(follow, 60)
    assert r.rc == 4, r.err
    assert lines_of(r.out) == ["[rank 0] started"] and "cancelled" in r.err


async def test_logs_follow_resumes_after_a_dropped_connection(
        cli: Any, gateway: RunningGateway, scheduler: Cluster, forwarder: CuttingForwarder, tmp_path: Path) -> None:
    await scheduler.add_agent("node-a")
    go_1, go_2 = tmp_path / "go-1", tmp_path / "go-2"
    job = await scheduler.submit(python(PHASES, f"""
        phase(0)
        phase(1, {str(go_1)!r})
        phase(2, {str(go_2)!r})
    """), gpus=2)
    follow = asyncio.create_task(cli("logs", job.id, "-f", "--url", forwarder.url))

    async def forwarded(count: int) -> bool:
        return forwarder.lines_forwarded >= count

    await eventually(lambda: forwarded(10), timeout=30, what="the first phase of both ranks to be forwarded")
    forwarder.cut()
    go_1.touch()  # the second phase is written while the CLI is cut off, or reconnecting

    async def resumed() -> bool:
        return len(forwarder.requests) >= 2 and forwarder.lines_forwarded >= 20

    await eventually(resumed, timeout=30, what="the CLI to reconnect and get the second phase")
    go_2.touch()
    r = await asyncio.wait_for(follow, 60)
    assert r.rc == 0, r.err
    printed = lines_of(r.out)
    expected = [f"[rank {rank}] r{rank} phase{p} line{i}" for rank in (0, 1) for p in range(3) for i in range(5)]
    assert sorted(printed) == sorted(expected)  # each line once: nothing twice, nothing missing
    for rank in (0, 1):
        assert [ln for ln in printed if ln.startswith(f"[rank {rank}]")] == [
            ln for ln in expected if ln.startswith(f"[rank {rank}]")]
    assert "reconnecting" in r.err
    # The reconnect named the last event the CLI had seen.
    assert b"last-event-id: 1:0=" in forwarder.requests[1].lower()


async def test_an_earlier_attempts_logs_after_a_restart_on_another_node(
        cli: Any, gateway: RunningGateway, scheduler: Cluster, tmp_path: Path) -> None:
    await scheduler.add_agent("node-a")
    await scheduler.add_agent("node-b")
    fail = tmp_path / "fail"
    r = await cli("submit", "--name", "twice", "--max-restarts", "1", "--restart-backoff", "0.1", "--json", "--",
                  *python(f"""
        import os, pathlib, sys, time
        attempt = int(os.environ["TRAINYARD_ATTEMPT"])
        print(f"attempt {{attempt}} on {{os.environ['TRAINYARD_NNODES']}} node")
        if attempt == 1:
            while not pathlib.Path({str(fail)!r}).exists():
                time.sleep(0.02)
            print("attempt 1 fails")
            sys.exit(1)
    """))
    assert r.rc == 0, r.err
    job_id = json.loads(r.out)["id"]
    first = await scheduler.wait_state(job_id, types_pb2.JOB_STATE_RUNNING)
    (node_1,) = [a.node_id for a in first.placement]
    # Follow from the start: the stream goes on into the next attempt, on the other node.
    follow = asyncio.create_task(cli("logs", job_id, "-f"))

    async def streaming() -> bool:
        return any(req.job_id == job_id for req in scheduler.agent_calls[node_1].stream_requests("StreamWorkerLogs"))

    await eventually(streaming, what="logs -f to stream attempt 1")
    async with gateway.client(gateway.admin_token) as http:
        assert (await http.post(f"/v1/nodes/{node_1}:cordon", json={"reason": "test"})).status_code == 200
    fail.touch()
    done = await scheduler.wait_state(job_id, types_pb2.JOB_STATE_SUCCEEDED)
    (node_2,) = [a.node_id for a in done.placement]
    assert node_2 != node_1 and done.attempt == 2
    followed = await asyncio.wait_for(follow, 60)
    assert followed.rc == 0, followed.err
    assert lines_of(followed.out) == ["[rank 0] attempt 1 on 1 node", "[rank 0] attempt 1 fails",
                                      "[rank 0] attempt 2 on 1 node"]
    assert "job restarted: attempt 2" in followed.err

    earlier = await cli("logs", job_id, "--attempt", "1")
    assert earlier.rc == 0 and lines_of(earlier.out) == ["[rank 0] attempt 1 on 1 node", "[rank 0] attempt 1 fails"]
    current = await cli("logs", job_id)
    assert lines_of(current.out) == ["[rank 0] attempt 2 on 1 node"]
    every = await cli("logs", job_id, "-f", "--attempt", "0", "--rank", "0")
    assert every.rc == 0 and sorted(lines_of(every.out)) == sorted(lines_of(followed.out))
    # Attempt 1's lines came from node_1's agent, which still has them; node_2 never ran attempt 1.
    asked = [(c.attempt, c.job_id) for c in scheduler.agent_calls[node_1].requests("GetWorkerLogs")]
    assert (1, job_id) in asked
    assert all(c.attempt != 1 for c in scheduler.agent_calls[node_2].requests("GetWorkerLogs"))
