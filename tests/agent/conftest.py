"""Fixtures of the node agent's tests (helpers live in agent_kit.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc.aio
import pytest

from tests.agent.agent_kit import TREE, RecordingSink, agent_settings, make_supervisor
from tests.agent.scheduler_double import RecordingNodeService, serve
from trainyard.agent.v1 import agent_pb2_grpc
from trainyard_agent.app import AgentApp
from trainyard_agent.workers.supervisor import Supervisor


@pytest.fixture
def sink() -> RecordingSink:
    return RecordingSink()


@pytest.fixture
async def supervisor(tmp_path: Path, sink: RecordingSink) -> AsyncIterator[Supervisor]:
    sup = make_supervisor(tmp_path / "state", sink)
    try:
        yield sup
    finally:
        await sup.close(kill=True)


@pytest.fixture
def tree_script(tmp_path: Path) -> Path:
    path = tmp_path / "tree.py"
    path.write_text(TREE)
    return path


class Scheduler:
    """The recording NodeService on a real port; `restart()` brings a new server up on the same port."""

    def __init__(self, service: RecordingNodeService, server: grpc.aio.Server, port: int) -> None:
        self.service, self.server, self.port = service, server, port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def stop(self) -> None:
        await self.server.stop(grace=None)

    async def restart(self) -> None:
        await self.stop()
        self.server, _ = await serve(self.service, self.port)


@pytest.fixture
async def scheduler() -> AsyncIterator[Scheduler]:
    service = RecordingNodeService()
    server, port = await serve(service)
    sched = Scheduler(service, server, port)
    try:
        yield sched
    finally:
        await sched.stop()


@pytest.fixture
async def agent(tmp_path: Path, scheduler: Scheduler) -> AsyncIterator[AgentApp]:
    app = AgentApp(agent_settings(tmp_path / "state", scheduler.address))
    await app.start()
    try:
        yield app
    finally:
        await app.stop(kill_workers=True)


@pytest.fixture
async def agent_stub(agent: AgentApp) -> AsyncIterator[agent_pb2_grpc.AgentServiceStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{agent.grpc_port}") as channel:
        yield agent_pb2_grpc.AgentServiceStub(channel)
