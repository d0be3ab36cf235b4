"""AgentService through a real channel to an AgentApp on port 0 (simulated h100x8, tmp state dir)."""

from __future__ import annotations

import asyncio
import sys

import grpc
import grpc.aio
import pytest

from tests.agent.agent_kit import until
from tests.agent.conftest import Scheduler
from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard.common.v1 import types_pb2
from trainyard_agent.app import AgentApp
from trainyard_agent.workers import records

PY = sys.executable


def launch_req(job_id: str, code: str, *, ranks: int = 1, **kw: object) -> agent_pb2.LaunchWorkersRequest:
    fields: dict[str, object] = dict(
        job_id=job_id, attempt=1, command=[PY, "-c", code], leader_epoch=1,  # the recording scheduler's epoch
        env={"WORLD_SIZE": str(ranks), "TRAINYARD_JOB_ID": job_id},
        workers=[agent_pb2.WorkerSpec(rank=r, local_rank=r, gpu_indices=[r]) for r in range(ranks)])
    fields.update(kw)
    return agent_pb2.LaunchWorkersRequest(**fields)  # type: ignore[arg-type]


async def test_launch_logs_exit_report_and_list(agent: AgentApp, scheduler: Scheduler,
                                                agent_stub: agent_pb2_grpc.AgentServiceStub) -> None:
    code = "import os, sys; print('rank', os.environ['RANK'], os.environ['GLOO_SOCKET_IFNAME']); sys.exit(3)"
    resp = await agent_stub.LaunchWorkers(launch_req("job-1", code, ranks=2))
    assert len(resp.pids) == 2 and not resp.already_running
    await until(lambda: len(scheduler.service.exits) == 2, "both exits to reach the scheduler")
    exits = sorted(scheduler.service.exits, key=lambda e: e.exit.rank)
    assert [(e.node_id, e.job_id, e.attempt, e.exit.rank, e.exit.exit_code, e.exit.signal, e.exit.node_id)
            for e in exits] == [("node-a", "job-1", 1, 0, 3, 0, "node-a"), ("node-a", "job-1", 1, 1, 3, 0, "node-a")]
    assert all(e.exit.exited_at.seconds > 0 for e in exits)

    logs = await agent_stub.GetWorkerLogs(agent_pb2.GetWorkerLogsRequest(job_id="job-1"))
    assert [(ln.rank, ln.stream, ln.text, ln.attempt) for ln in logs.lines] == [
        (0, "stdout", "rank 0 lo", 1), (1, "stdout", "rank 1 lo", 1)]

    listed = await agent_stub.ListWorkers(agent_pb2.ListWorkersRequest())
    assert sorted((w.rank, w.running, w.exit_code) for w in listed.workers) == [(0, False, 3), (1, False, 3)]
    again = await agent_stub.LaunchWorkers(launch_req("job-1", code, ranks=2))
    assert again.already_running and list(again.pids) == list(resp.pids)

    assert agent.supervisor is not None
    record = records.load(agent.supervisor.jobs_root / "job-1" / "attempt-1" / records.RECORD_NAME)
    await until(lambda: all(w.reported for w in records.load(  # type: ignore[union-attr]
        agent.supervisor.jobs_root / "job-1" / "attempt-1" / records.RECORD_NAME).workers),
        "the acknowledged exits to be marked reported")
    assert record is not None


async def test_stop_over_grpc(agent_stub: agent_pb2_grpc.AgentServiceStub, scheduler: Scheduler) -> None:
    await agent_stub.LaunchWorkers(launch_req("job-stop", "import time; time.sleep(300)", ranks=2))
    resp = await agent_stub.StopWorkers(agent_pb2.StopWorkersRequest(job_id="job-stop", attempt=1,
                                                                      grace_period_ms=500, reason="cancel"))
    assert resp.stopped == 2
    listed = await agent_stub.ListWorkers(agent_pb2.ListWorkersRequest())
    assert {(w.running, w.signal) for w in listed.workers} == {(False, 15)}
    await until(lambda: {e.exit.signal for e in scheduler.service.exits} == {15}
                and len(scheduler.service.exits) == 2, "the stopped workers' exits to be reported")
    assert (await agent_stub.StopWorkers(agent_pb2.StopWorkersRequest(job_id="job-stop", attempt=1))).stopped == 0
    assert (await agent_stub.StopWorkers(agent_pb2.StopWorkersRequest(job_id="nope", attempt=1))).stopped == 0


async def test_stream_logs_follows_until_the_workers_exit(agent_stub: agent_pb2_grpc.AgentServiceStub) -> None:
    code = "import time\nfor i in range(10):\n    print(i)\n    time.sleep(0.05)\n"
    await agent_stub.LaunchWorkers(launch_req("job-stream", code))
    texts: list[str] = []

    async def follow() -> None:
        async for chunk in agent_stub.StreamWorkerLogs(agent_pb2.GetWorkerLogsRequest(job_id="job-stream")):
            texts.extend(ln.text for ln in chunk.lines)

    await asyncio.wait_for(follow(), timeout=20)
    assert texts == [str(i) for i in range(10)]


@pytest.mark.parametrize("call,code,message", [
    (lambda s: s.LaunchWorkers(launch_req("job-x", "pass", command=[])), grpc.StatusCode.INVALID_ARGUMENT,
     "command is empty"),
    (lambda s: s.LaunchWorkers(agent_pb2.LaunchWorkersRequest(
        job_id="job-x", attempt=1, command=["true"], leader_epoch=1,
        workers=[agent_pb2.WorkerSpec(rank=0, gpu_indices=[8])])),
     grpc.StatusCode.INVALID_ARGUMENT, "asks for GPU 8, but node node-a has GPUs 0-7"),
    (lambda s: s.LaunchWorkers(launch_req("job-x", "pass", working_dir="/no/such/dir")),
     grpc.StatusCode.INVALID_ARGUMENT, "working_dir /no/such/dir does not exist"),
    (lambda s: s.GetWorkerLogs(agent_pb2.GetWorkerLogsRequest(job_id="unknown-job")), grpc.StatusCode.NOT_FOUND,
     "job unknown-job has no workers on this node"),
    (lambda s: s.StreamWorkerLogs(agent_pb2.GetWorkerLogsRequest(job_id="unknown-job")).read(),
     grpc.StatusCode.NOT_FOUND, "no workers on this node"),
    (lambda s: s.StopWorkers(agent_pb2.StopWorkersRequest(job_id="j", attempt=1, grace_period_ms=-1)),
     grpc.StatusCode.INVALID_ARGUMENT, "grace_period_ms must be >= 0"),
    (lambda s: s.InjectFault(agent_pb2.InjectFaultRequest(gpu_index=0, kind="meteor")),
     grpc.StatusCode.INVALID_ARGUMENT, "unknown fault kind 'meteor'"),
])
async def test_errors_map_to_status_codes(agent_stub: agent_pb2_grpc.AgentServiceStub, call: object,
                                          code: grpc.StatusCode, message: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(agent_stub)  # type: ignore[operator]
    assert info.value.code() == code and message in (info.value.details() or "")


async def test_a_stale_leader_is_refused_after_a_newer_epoch_was_seen(
        agent: AgentApp, agent_stub: agent_pb2_grpc.AgentServiceStub, scheduler: Scheduler) -> None:
    scheduler.service.epoch = 9
    await until(lambda: agent.fence.highest == 9, "the heartbeat answers' epoch to reach the fence")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await agent_stub.LaunchWorkers(launch_req("job-old-leader", "pass", leader_epoch=8))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "stale scheduler leader" in (info.value.details() or "")


async def test_injected_xid_reaches_the_scheduler_at_once(tmp_path: object, scheduler: Scheduler,
                                                          agent_stub: agent_pb2_grpc.AgentServiceStub) -> None:
    scheduler.service.interval_ms = 60_000  # only an immediate push can deliver the change in time
    scheduler.service.reregister_once = True  # re-register so the long interval applies
    await until(lambda: len(scheduler.service.registers) >= 2, "the agent to register again")
    beats = len(scheduler.service.heartbeats)
    resp = await agent_stub.InjectFault(agent_pb2.InjectFaultRequest(gpu_index=3, kind="xid", xid=79))
    assert resp.gpu.index == 3 and resp.gpu.health == types_pb2.GPU_HEALTH_UNHEALTHY
    assert "fallen off the bus" in resp.gpu.health_reason
    await until(lambda: scheduler.service.gpu_health_seen(3) == types_pb2.GPU_HEALTH_UNHEALTHY,
                "the scheduler to see GPU 3 unhealthy", timeout=2.0)
    assert len(scheduler.service.heartbeats) <= beats + 2
    # An application XID changes nothing.
    ok = await agent_stub.InjectFault(agent_pb2.InjectFaultRequest(gpu_index=1, kind="xid", xid=13))
    assert ok.gpu.health == types_pb2.GPU_HEALTH_HEALTHY
