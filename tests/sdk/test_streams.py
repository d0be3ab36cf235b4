"""The SDK's streams end to end, with both clients, against a real gateway, a real scheduler and real agents
running real worker processes: following a job's logs to its end, watching one job and a team's jobs, and a
dropped connection resumed from the last event id, nothing twice and nothing lost.

The connection is dropped for real: the client talks to the gateway through a TCP relay (`Relay`) that the test
cuts mid-stream (both sockets aborted, as a load balancer or a lost host would), and the relay shows what each
connection asked for (the Last-Event-ID of the reconnection). A test acts at a point of a stream when the
client has handed it the events before it, never after a sleep."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.gateway.support import Cluster, RunningGateway, python, wait_for_file
from trainyard.common.v1 import types_pb2
from trainyard_gateway.schemas.jobs import Job
from trainyard_gateway.schemas.logs import EndEvent, LineEvent
from trainyard_gateway.schemas.streams import JobEnd
from trainyard_sdk import NotFound, Reconnect
from trainyard_sdk.streams import JobChanged, JobsSnapshot

from .support import Api, Sdk

PRINT_RANKS = """
    import os
    rank = int(os.environ["RANK"])
    for i in range({start}, {stop}):
        print(f"r{{rank}} line{{i}}")
"""


class Relay:
    """A TCP relay to `upstream` on a free port of 127.0.0.1: each connection is piped both ways until `cut()`
    aborts every open one. `heads` holds the request head that began each connection."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.heads: list[str] = []
        self._open: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._pipe, "127.0.0.1", 0)

    async def stop(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def cut(self) -> None:
        for writer in self._open:
            writer.transport.abort()
        self._open.clear()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self._open += [writer, up_writer]
        first = True

        async def copy(source: asyncio.StreamReader, sink: asyncio.StreamWriter, note: bool) -> None:
            nonlocal first
            with contextlib.suppress(ConnectionError, OSError):
                while data := await source.read(65536):
                    if note and first:
                        self.heads.append(data.split(b"\r\n\r\n", 1)[0].decode("latin-1"))
                        first = False
                    sink.write(data)
                    await sink.drain()
            sink.transport.abort()

        await asyncio.gather(copy(reader, up_writer, True), copy(up_reader, writer, False))


@contextlib.asynccontextmanager
async def relay_to(gateway: RunningGateway) -> AsyncIterator[Relay]:
    relay = Relay(gateway.app.http_port)
    await relay.start()
    try:
        yield relay
    finally:
        await relay.stop()


@dataclass
class Read:
    items: list[Any]
    reconnects: int
    last_event_id: str


async def read_stream(api: Api, open_stream: Callable[[Any], Any], on_item: Callable[[Any], None] = lambda _: None,
                      until: Callable[[Any], bool] = lambda _: False) -> Read:
    """The items of the stream `open_stream(client)` opens, read to its end or to the first item `until` holds
    for (then closed); `on_item` is called in the test's loop with each item as the client hands it over."""
    if api.is_async:
        items: list[Any] = []
        async with open_stream(api.client) as stream:
            async for item in stream:
                items.append(item)
                on_item(item)
                if until(item):
                    break
        return Read(items, stream.resume.reconnects, stream.last_event_id)
    loop = asyncio.get_running_loop()

    def read() -> Read:
        got: list[Any] = []
        with open_stream(api.client) as stream:
            for item in stream:
                got.append(item)
                loop.call_soon_threadsafe(on_item, item)
                if until(item):
                    break
        return Read(got, stream.resume.reconnects, stream.last_event_id)

    return await asyncio.to_thread(read)


def lines(items: list[Any]) -> list[tuple[int, str]]:
    return [(i.rank, i.text) for i in items if isinstance(i, LineEvent)]


async def test_follow_logs_to_the_end_through_a_dropped_connection(
        sdk: Sdk, cluster_gateway: RunningGateway, cluster: Cluster, tmp_path: Path) -> None:
    go = tmp_path / "go"
    api = sdk(cluster_gateway.url, await cluster_gateway.create_token("vision", "alice"))
    job = await api(lambda c: c.submit_job({"name": "talk", "resources": {"nodes": 2, "gpus_per_node": 1},
                                            "command": python(PRINT_RANKS.format(start=0, stop=10), wait_for_file(go),
                                                              PRINT_RANKS.format(start=10, stop=15))}))
    async with relay_to(cluster_gateway) as relay:
        told: list[tuple[str, float]] = []
        relayed = sdk(relay.url, api.client.target.token, reconnect=Reconnect(backoff_s=0.05),
                      on_reconnect=lambda error, delay: told.append((type(error).__name__, delay)))
        seen = 0

        def on_item(item: Any) -> None:
            nonlocal seen
            if isinstance(item, LineEvent):
                seen += 1
                if seen == 7:  # mid-stream, with lines of the first ten still to come
                    relay.cut()
                if seen == 20:  # every line written before `go`, after the reconnect
                    go.touch()

        read = await read_stream(relayed, lambda c: c.follow_logs(job.id), on_item)
    items, got = read.items, lines(read.items)
    assert len(got) == len(set(got)) == 30  # nothing twice
    assert set(got) == {(r, f"r{r} line{i}") for r in (0, 1) for i in range(15)}  # nothing lost
    for rank in (0, 1):
        assert [t for r, t in got if r == rank] == [f"r{rank} line{i}" for i in range(15)]  # in order
    assert isinstance(items[-1], EndEvent) and (items[-1].state, items[-1].exit_code) == ("succeeded", 0)
    assert read.reconnects == 1
    assert told == [("ConnectionFailed", 0.05)]  # the client's on_reconnect, told once, before the wait
    assert len(relay.heads) == 2 and "last-event-id:" not in relay.heads[0].lower()
    assert "last-event-id: " in relay.heads[1].lower()  # resumed after the last event the client had


async def test_follow_logs_of_a_finished_job_with_tail_and_rank(sdk: Sdk, cluster_gateway: RunningGateway,
                                                                 cluster: Cluster) -> None:
    api = sdk(cluster_gateway.url, cluster_gateway.admin_token)
    job = await cluster.submit(python(PRINT_RANKS.format(start=0, stop=5)), gpus=3)
    await cluster.wait_state(job.id, types_pb2.JOB_STATE_SUCCEEDED)
    read = await read_stream(api, lambda c: c.follow_logs(job.id, tail=2, rank=[0, 2]))
    assert sorted(lines(read.items)) == [(0, "r0 line3"), (0, "r0 line4"), (2, "r2 line3"), (2, "r2 line4")]
    assert isinstance(read.items[-1], EndEvent) and read.reconnects == 0
    with pytest.raises(NotFound):  # refused before any stream, and not retried
        await api(lambda c: c.follow_logs("job-00000000000000000000"))


async def test_watch_a_job_to_its_end_and_resume(sdk: Sdk, live_gateway: RunningGateway, scheduler: Cluster,
                                                 tmp_path: Path) -> None:
    api = sdk(live_gateway.url, await live_gateway.create_token("vision", "vic", role="viewer"))
    # Long enough to be read as running: a change is shown as the job reads when the watch reads it, so a job
    # that ends within milliseconds of starting may go from admitted straight to its end in the stream.
    job = await scheduler.submit(python("import time; time.sleep(1.0); print('x')"), team="vision")
    started = asyncio.Event()

    def on_item(item: Any) -> None:
        if isinstance(item, Job) and item.state == "pending":
            started.set()

    watching = asyncio.create_task(read_stream(api, lambda c: c.watch_job(job.id), on_item))
    await asyncio.wait_for(started.wait(), 30)
    await scheduler.add_agent("node-a", state_dir=tmp_path / "node-a")  # now it runs
    read = await asyncio.wait_for(watching, 60)
    states = [i.state for i in read.items if isinstance(i, Job)]
    assert states[0] == "pending" and "running" in states and states[-1] == "succeeded"
    end = read.items[-1]
    assert isinstance(end, JobEnd) and (end.state, end.exit_code) == ("succeeded", 0)
    # From the last event seen: the job has not changed since, so only the end comes.
    again = await read_stream(api, lambda c: c.watch_job(job.id, last_event_id=read.last_event_id))
    assert [type(i) for i in again.items] == [JobEnd]


async def test_watch_a_teams_jobs(sdk: Sdk, live_gateway: RunningGateway, scheduler: Cluster) -> None:
    alice = await live_gateway.create_token("vision", "alice")
    api = sdk(live_gateway.url, alice)
    first = await api(lambda c: c.submit_job({"name": "one", "command": ["true"],
                                              "resources": {"nodes": 1, "gpus_per_node": 1}}))
    await scheduler.submit(["true"], name="other-team", team="nlp")
    seen = asyncio.Event()

    def on_item(item: Any) -> None:
        if isinstance(item, JobChanged) and item.job.id == first.id:
            seen.set()

    def is_cancelled(item: Any) -> bool:
        return isinstance(item, JobChanged) and item.job.id == first.id and item.job.state == "cancelled"

    watching = asyncio.create_task(read_stream(api, lambda c: c.watch_jobs(), on_item, until=is_cancelled))
    await asyncio.wait_for(seen.wait(), 30)  # the snapshot is in
    await api(lambda c: c.cancel_job(first.id))
    read = await asyncio.wait_for(watching, 30)  # closed by the client after the cancelled job
    snapshot, *changes = read.items
    assert isinstance(snapshot, JobsSnapshot) and snapshot.jobs == 1  # the team's one job, not nlp's
    assert (changes[0].job.id, changes[0].job.state, changes[0].deleted) == (first.id, "pending", False)
    assert all(c.job.team == "vision" for c in changes) and changes[-1].job.state == "cancelled"
