"""GET /v1/jobs/{id}/logs: every rank's lines from every node of the placement, ordered by rank, each
prefixed with its rank; an unreachable node is named, not fatal (stub scheduler and agents, real gRPC)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from trainyard.agent.v1 import agent_pb2
from trainyard.common.v1 import types_pb2
from trainyard_core.testing.etcd import free_port
from trainyard_gateway.joblogs import NodeLogs, render
from trainyard_gateway.schemas.jobs import NodeAssignment
from trainyard_gateway.schemas.logs import LogLine
from trainyard_gateway.testing import RunningGateway, StubAgent, StubScheduler


@pytest.fixture
async def agents() -> AsyncIterator[list[StubAgent]]:
    started = [StubAgent(), StubAgent()]
    for agent in started:
        await agent.start()
    try:
        yield started
    finally:
        for agent in started:
            await agent.stop()


def _line(rank: int, text: str, attempt: int = 1) -> agent_pb2.LogLine:
    return agent_pb2.LogLine(rank=rank, text=text, stream="stdout", attempt=attempt)


def _placed_job(stub: StubScheduler, addresses: list[str], team: str = "vision") -> types_pb2.Job:
    stub.nodes = [types_pb2.Node(node_id=f"node-{i}", agent_address=a) for i, a in enumerate(addresses)]
    placement = [types_pb2.NodeAssignment(node_id=f"node-{i}", node_rank=i, gpu_indices=[0, 1],
                                          ranks=[2 * i, 2 * i + 1]) for i in range(len(addresses))]
    return stub.add_job(team=team, state=types_pb2.JOB_STATE_RUNNING, placement=placement)


async def test_logs_of_every_rank_ordered_by_rank(stub_gateway: RunningGateway, stub_scheduler: StubScheduler,
                                                  agents: list[StubAgent]) -> None:
    job = _placed_job(stub_scheduler, [agents[0].address, agents[1].address])
    # Each agent returns its ranks interleaved, as the workers wrote them.
    agents[0].lines[job.id] = [_line(1, "b1"), _line(0, "a1"), _line(0, "a2"), _line(1, "b2")]
    agents[1].lines[job.id] = [_line(3, "d1"), _line(2, "c1")]
    alice = await stub_gateway.create_token("vision", "alice")
    async with stub_gateway.client(alice) as http:
        reply = await http.get(f"/v1/jobs/{job.id}/logs")
        tailed = await http.get(f"/v1/jobs/{job.id}/logs", params={"tail": 1})
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("text/plain")
    assert reply.text.splitlines() == ["[rank 0] a1", "[rank 0] a2", "[rank 1] b1", "[rank 1] b2",
                                       "[rank 2] c1", "[rank 3] d1"]
    assert tailed.text.splitlines() == ["[rank 0] a2", "[rank 1] b2", "[rank 2] c1", "[rank 3] d1"]
    asked = [(c.job_id, c.attempt, c.tail_lines) for a in agents for c in a.calls]
    assert asked == [(job.id, 1, 0), (job.id, 1, 1), (job.id, 1, 0), (job.id, 1, 1)]


async def test_an_unreachable_node_is_named(stub_gateway: RunningGateway, stub_scheduler: StubScheduler,
                                            agents: list[StubAgent]) -> None:
    job = _placed_job(stub_scheduler, [agents[0].address, f"127.0.0.1:{free_port()}"])
    agents[0].lines[job.id] = [_line(0, "hello"), _line(1, "world")]
    async with stub_gateway.client(stub_gateway.admin_token) as http:
        reply = await http.get(f"/v1/jobs/{job.id}/logs")
    assert reply.status_code == 200
    lines = reply.text.splitlines()
    assert lines[:2] == ["[rank 0] hello", "[rank 1] world"]
    assert lines[2].startswith("[gateway] no logs for ranks 2,3 on node node-1")


async def test_a_node_that_has_not_launched_yet_adds_nothing(
        stub_gateway: RunningGateway, stub_scheduler: StubScheduler, agents: list[StubAgent]) -> None:
    job = _placed_job(stub_scheduler, [agents[0].address, agents[1].address])
    agents[0].lines[job.id] = [_line(0, "started")]
    async with stub_gateway.client(stub_gateway.admin_token) as http:
        reply = await http.get(f"/v1/jobs/{job.id}/logs")
    assert reply.status_code == 200 and reply.text == "[rank 0] started\n"


async def test_no_node_answering_is_503(stub_gateway: RunningGateway, stub_scheduler: StubScheduler) -> None:
    job = _placed_job(stub_scheduler, [f"127.0.0.1:{free_port()}"])
    async with stub_gateway.client(stub_gateway.admin_token) as http:
        reply = await http.get(f"/v1/jobs/{job.id}/logs")
    assert reply.status_code == 503
    assert "node-0" in reply.json()["error"]["message"]


async def test_pending_job_has_empty_logs(stub_gateway: RunningGateway, stub_scheduler: StubScheduler) -> None:
    job = stub_scheduler.add_job(team="vision")
    async with stub_gateway.client(stub_gateway.admin_token) as http:
        reply = await http.get(f"/v1/jobs/{job.id}/logs")
    assert reply.status_code == 200 and reply.text == ""


def test_render_orders_attempts_then_ranks_and_caps_the_size() -> None:
    assignment = NodeAssignment(node_id="n", node_rank=0, gpu_indices=[0], ranks=[0, 1])
    lines = [LogLine(1, 2, "stdout", "second-attempt r1\n"), LogLine(0, 1, "stdout", "first r0"),
             LogLine(0, 2, "stderr", "second-attempt r0"), LogLine(1, 1, "stdout", "first r1")]
    text = render([NodeLogs(assignment, lines)], max_lines=100)
    assert text.splitlines() == ["[rank 0] first r0", "[rank 1] first r1", "[rank 0] second-attempt r0",
                                 "[rank 1] second-attempt r1"]
    capped = render([NodeLogs(assignment, lines)], max_lines=2).splitlines()
    assert capped[0].startswith("[gateway] 2 earlier lines left out")
    assert capped[1:] == ["[rank 0] second-attempt r0", "[rank 1] second-attempt r1"]
