"""The worker environment of a 2-node x 2-GPU gang, exactly: real scheduler, two real agents (simulated
A100s), real worker processes printing what they were given."""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc.aio
import pytest

from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_agent.app import AgentApp
from trainyard_agent.settings import AgentSettings
from trainyard_core.testing.wait import eventually
from trainyard_scheduler.app import SchedulerApp
from trainyard_scheduler.settings import SchedulerSettings

KEYS = ["MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
        "GROUP_RANK", "CUDA_VISIBLE_DEVICES", "TRAINYARD_JOB_ID", "TRAINYARD_ATTEMPT", "TRAINYARD_NNODES", "MY_VAR"]
PRINT_ENV = f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {KEYS!r}}}))"


@pytest.fixture
async def cluster(etcd_settings: dict[str, str], key_prefix: str,
                  tmp_path: Path) -> AsyncIterator[tuple[SchedulerApp, list[AgentApp]]]:
    sched = SchedulerApp(SchedulerSettings(**etcd_settings, etcd_prefix=key_prefix.rstrip("/"),
                                           listen_port=0, heartbeat_interval_ms=200, node_timeout_s=3.0,
                                           reconcile_interval_s=0.2, stop_grace_s=1.0))
    await sched.start()
    agents = []
    for node_id in ("node-a", "node-b"):
        agent = AgentApp(AgentSettings(node_id=node_id, gpu_profile="a100x4",
                                       scheduler_address=f"127.0.0.1:{sched.grpc_port}",
                                       state_dir=str(tmp_path / node_id), stop_grace_s=1.0, single_tenant=True))
        await agent.start()
        agents.append(agent)
    try:
        yield sched, agents
    finally:
        for agent in agents:
            await agent.stop(kill_workers=True)
        await sched.stop()


async def test_two_nodes_two_gpus_each(cluster: tuple[SchedulerApp, list[AgentApp]]) -> None:
    sched, agents = cluster
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sched.grpc_port}") as channel:
        jobs = scheduler_pb2_grpc.JobServiceStub(channel)
        nodes = scheduler_pb2_grpc.NodeServiceStub(channel)

        async def both_ready() -> bool:
            try:
                listed = (await nodes.ListNodes(scheduler_pb2.ListNodesRequest())).nodes
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE:  # not the leader yet (only it knows the nodes)
                    return False
                raise
            return sum(n.state == types_pb2.NODE_STATE_READY for n in listed) == 2

        await eventually(both_ready, what="two ready nodes")
        spec = types_pb2.JobSpec(name="env", command=[sys.executable, "-c", PRINT_ENV], env={"MY_VAR": "x y"},
                                 resources=types_pb2.Resources(nodes=2, gpus_per_node=2))
        job_id = (await jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec))).job.id

        async def done() -> types_pb2.Job | None:
            job = (await jobs.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id))).job
            return job if job.state == types_pb2.JOB_STATE_SUCCEEDED else None

        job = await eventually(done, timeout=30, what="the gang to succeed")

    by_node = {a.node_id: a for a in job.placement}
    envs: dict[int, dict[str, str]] = {}
    for agent in agents:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{agent.grpc_port}") as channel:
            logs = await agent_pb2_grpc.AgentServiceStub(channel).GetWorkerLogs(
                agent_pb2.GetWorkerLogsRequest(job_id=job_id))
        for line in logs.lines:
            if line.stream == "stdout":
                envs[line.rank] = json.loads(line.text)
    assert sorted(envs) == [0, 1, 2, 3]
    master = next(a for a in job.placement if a.node_rank == 0)
    port = envs[0]["MASTER_PORT"]
    assert 29500 <= int(port) <= 29999
    for assignment in job.placement:
        for local, (rank, gpu) in enumerate(zip(assignment.ranks, assignment.gpu_indices, strict=True)):
            assert envs[rank] == {
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "4", "RANK": str(rank),
                "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": "2", "NODE_RANK": str(assignment.node_rank),
                "GROUP_RANK": str(assignment.node_rank), "CUDA_VISIBLE_DEVICES": str(gpu),
                "TRAINYARD_JOB_ID": job_id, "TRAINYARD_ATTEMPT": "1", "TRAINYARD_NNODES": "2", "MY_VAR": "x y"}
    # Ranks are contiguous per node, node 0 holds ranks 0-1.
    assert list(master.ranks) == [0, 1] and sorted(by_node) == ["node-a", "node-b"]


def test_workers_learn_the_checkpoint_store_and_the_jobs_checkpoint_policy() -> None:
    from dataclasses import replace as _replace

    from trainyard_scheduler.domain.models import Allocation, CheckpointPolicy, NodeAssignment
    from trainyard_scheduler.launch import node_launches

    from .builders import NOW, make_job

    job = make_job(gpus=1)
    job = _replace(job, spec=_replace(job.spec, checkpoint=CheckpointPolicy(every_steps=500, interval_s=1800,
                                                                            keep_last=3)))
    alloc = Allocation(job.id, 2, (NodeAssignment("n-a", 0, (0,), (0,)),), "h", 29500, NOW)
    (launch,) = node_launches(job, alloc, "10.0.0.5:50053")
    assert {k: v for k, v in launch.env.items() if k.startswith("TRAINYARD_CHECKPOINT")} == {
        "TRAINYARD_CHECKPOINT_STORE": "10.0.0.5:50053", "TRAINYARD_CHECKPOINT_EVERY_STEPS": "500",
        "TRAINYARD_CHECKPOINT_INTERVAL_S": "1800", "TRAINYARD_CHECKPOINT_KEEP_LAST": "3"}
    assert launch.env["TRAINYARD_ATTEMPT"] == "2"  # a restart reaches the same store under the same job id
    (bare,) = node_launches(make_job(gpus=1), alloc)
    assert not any(k.startswith("TRAINYARD_CHECKPOINT") for k in bare.env)
