"""Fixtures of the node agent's tests (helpers live in agent_kit.py). The agent talks to the real scheduler
(`agent_kit.Scheduler`) on the session's etcd; the only fake is the simulated NVML."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc.aio
import pytest

from tests.agent.agent_kit import TREE, RecordingSink, Scheduler, agent_settings, make_supervisor
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


@pytest.fixture
def scheduler_options() -> dict[str, object]:
    """SchedulerSettings overrides; a test changes them with `@pytest.mark.parametrize("scheduler_options", ...)`."""
    return {}


@pytest.fixture
async def scheduler(etcd_settings: dict[str, str], key_prefix: str,
                    scheduler_options: dict[str, object]) -> AsyncIterator[Scheduler]:
    sched = Scheduler(etcd_settings, key_prefix, **scheduler_options)
    await sched.start()
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
