"""The gateway's job feed stops when its stop lands as a message of the scheduler's job watch arrives.

On Python 3.11, `asyncio.wait_for` returns the result of an await that completed in the same turn as a cancel
and drops the cancel; the feed read its stream through it, and the scheduler's progress messages kept the
loop reading, so the gateway's stop (and a suite's teardown, once in CI) waited for ever. Here the feed's
stream is the real one from a real scheduler, and `JobFeed.stop` is started at the instant a message
arrives."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from trainyard.scheduler.v1 import scheduler_pb2
from trainyard_core.testing.wait import eventually, truthy
from trainyard_gateway import job_view_feed

from .view_support import deployment


class _Armed:
    """When `stop` is set: the next message the feed takes starts it (as a task) before the feed sees it."""

    def __init__(self) -> None:
        self.stop: Any = None
        self.task: asyncio.Task[None] | None = None


class _Messages:
    def __init__(self, messages: Any, armed: _Armed) -> None:
        self._messages = messages
        self._armed = armed

    def __aiter__(self) -> _Messages:
        return self

    async def __anext__(self) -> scheduler_pb2.WatchJobsResponse:
        message = await self._messages.__anext__()
        if self._armed.stop is not None and self._armed.task is None:
            self._armed.task = asyncio.create_task(self._armed.stop())
        return message


class _Call:
    def __init__(self, call: Any, armed: _Armed) -> None:
        self._call = call
        self._armed = armed

    def __aiter__(self) -> _Messages:
        return _Messages(self._call.__aiter__(), self._armed)

    def cancel(self) -> bool:
        return bool(self._call.cancel())


async def test_stop_returns_when_it_lands_as_a_message_arrives(
        etcd_settings: dict[str, str], key_prefix: str, tmp_path: Path, pki_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    armed = _Armed()
    real = job_view_feed.scheduler_pb2_grpc.JobWatchServiceStub

    class Stub:
        def __init__(self, channel: Any) -> None:
            self._stub = real(channel)

        def WatchJobs(self, request: scheduler_pb2.WatchJobsRequest) -> _Call:
            return _Call(self._stub.WatchJobs(request), armed)

    monkeypatch.setattr(job_view_feed.scheduler_pb2_grpc, "JobWatchServiceStub", Stub)
    async with deployment(etcd_settings, key_prefix + "feedstop", tmp_path, pki_dir) as d:
        feed = d.feed
        armed.stop = feed.stop
        # A submit makes the scheduler send a change at once (its progress messages would come anyway).
        async with d.gateway.client(d.gateway.admin_token) as http:
            reply = await http.post("/v1/jobs", json={"name": "feed-stop", "command": ["true"],
                                                      "resources": {"nodes": 1, "gpus_per_node": 1}})
            assert reply.status_code == 201, reply.text
        await eventually(lambda: truthy(armed.task), interval=0.01, what="a message of the job watch")
        assert armed.task is not None
        await asyncio.wait_for(asyncio.shield(armed.task), 10)  # waited for ever before
        assert not d.view.ready
