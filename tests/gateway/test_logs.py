"""GET /v1/jobs/{id}/logs: every rank's lines from every node of the placement, ordered by rank, each
prefixed with its rank; an unreachable node is named, not fatal. Real jobs run on real agents (simulated
GPUs) and are waited for before their logs are read."""

from __future__ import annotations

from pathlib import Path

from trainyard.common.v1 import types_pb2
from trainyard_gateway.joblogs import NodeLogs, render
from trainyard_gateway.schemas.jobs import NodeAssignment
from trainyard_gateway.schemas.logs import LogLine

from .support import Cluster, RunningGateway, python


async def test_logs_of_every_rank_ordered_by_rank(cluster_gateway: RunningGateway, cluster: Cluster) -> None:
    job = await cluster.submit(python("""
        import os
        rank = int(os.environ["RANK"])
        for i in range(1, 3 if rank < 2 else 2):
            print(f"{'abcd'[rank]}{i}")
    """), nodes=2, gpus=2, team="vision")
    done = await cluster.wait_state(job.id, types_pb2.JOB_STATE_SUCCEEDED)
    assert [a.ranks for a in done.placement] == [[0, 1], [2, 3]]
    alice = await cluster_gateway.create_token("vision", "alice")
    async with cluster_gateway.client(alice) as http:
        reply = await http.get(f"/v1/jobs/{job.id}/logs")
        tailed = await http.get(f"/v1/jobs/{job.id}/logs", params={"tail": 1})
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("text/plain")
    assert reply.text.splitlines() == ["[rank 0] a1", "[rank 0] a2", "[rank 1] b1", "[rank 1] b2",
                                       "[rank 2] c1", "[rank 3] d1"]
    assert tailed.text.splitlines() == ["[rank 0] a2", "[rank 1] b2", "[rank 2] c1", "[rank 3] d1"]
    # Each node's agent is asked for the job's current attempt, with the tail passed through.
    asked = [(c.job_id, c.attempt, c.tail_lines) for node in ("node-a", "node-b")
             for c in cluster.agent_calls[node].requests("GetWorkerLogs")]
    attempt = done.attempt
    assert asked == [(job.id, attempt, 0), (job.id, attempt, 1), (job.id, attempt, 0), (job.id, attempt, 1)]


async def test_an_unreachable_node_is_named(cluster_gateway: RunningGateway, cluster: Cluster) -> None:
    job = await cluster.submit(python("""
        import os
        print(["hello", "world", "from", "node-b"][int(os.environ["RANK"])])
    """), nodes=2, gpus=2)
    await cluster.wait_state(job.id, types_pb2.JOB_STATE_SUCCEEDED)
    await cluster.stop_agent("node-b")
    async with cluster_gateway.client(cluster_gateway.admin_token) as http:
        reply = await http.get(f"/v1/jobs/{job.id}/logs")
    assert reply.status_code == 200
    lines = reply.text.splitlines()
    assert lines[:2] == ["[rank 0] hello", "[rank 1] world"]
    assert lines[2].startswith("[gateway] no logs for ranks 2,3 on node node-b")
    assert len(lines) == 3


async def test_a_node_without_workers_of_the_job_adds_nothing(
        cluster_gateway: RunningGateway, cluster: Cluster, tmp_path: Path) -> None:
    """An agent that has no workers of a placed job (not launched yet, or here: its node's agent was
    replaced by one with an empty state directory) answers NOT_FOUND, which adds no lines."""
    job = await cluster.submit(python("""
        import os
        print("started" if os.environ["RANK"] == "0" else "lost with the old agent")
    """), nodes=2, gpus=1)
    await cluster.wait_state(job.id, types_pb2.JOB_STATE_SUCCEEDED)
    await cluster.stop_agent("node-b")
    await cluster.add_agent("node-b", state_dir=tmp_path / "node-b-replaced")
    async with cluster_gateway.client(cluster_gateway.admin_token) as http:
        reply = await http.get(f"/v1/jobs/{job.id}/logs")
    assert reply.status_code == 200 and reply.text == "[rank 0] started\n"
    assert [c.job_id for c in cluster.agent_calls["node-b"].requests("GetWorkerLogs")] == [job.id]


async def test_no_node_answering_is_503(cluster_gateway: RunningGateway, cluster: Cluster) -> None:
    job = await cluster.submit(python("print('bye')"))
    done = await cluster.wait_state(job.id, types_pb2.JOB_STATE_SUCCEEDED)
    (node,) = [a.node_id for a in done.placement]
    await cluster.stop_agent(node)
    async with cluster_gateway.client(cluster_gateway.admin_token) as http:
        reply = await http.get(f"/v1/jobs/{job.id}/logs")
    assert reply.status_code == 503
    assert node in reply.json()["error"]["message"]


async def test_pending_job_has_empty_logs(live_gateway: RunningGateway, scheduler: Cluster) -> None:
    job = await scheduler.submit(["true"], team="vision")
    async with live_gateway.client(live_gateway.admin_token) as http:
        reply = await http.get(f"/v1/jobs/{job.id}/logs")
    assert reply.status_code == 200 and reply.text == ""
    assert (await scheduler.job(job.id)).state == types_pb2.JOB_STATE_PENDING


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
