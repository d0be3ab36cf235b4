"""AgentService through a real channel to an AgentApp on port 0 (simulated h100x8, tmp state dir), registered
with the real scheduler."""

from __future__ import annotations

import asyncio
import sys

import grpc
import grpc.aio
import pytest

from tests.agent.agent_kit import Scheduler, until
from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard.common.v1 import types_pb2
from trainyard_agent.app import AgentApp
from trainyard_agent.workers import records
from trainyard_core.testing.wait import eventually

PY = sys.executable


def launch_req(job_id: str, code: str, epoch: int, *, ranks: int = 1, **kw: object) -> agent_pb2.LaunchWorkersRequest:
    """A launch as the scheduler sends it; `epoch` is its leader epoch (the agent refuses older ones)."""
    fields: dict[str, object] = dict(
        job_id=job_id, attempt=1, command=[PY, "-c", code], leader_epoch=epoch,
        env={"WORLD_SIZE": str(ranks), "TRAINYARD_JOB_ID": job_id},
        workers=[agent_pb2.WorkerSpec(rank=r, local_rank=r, gpu_indices=[r]) for r in range(ranks)])
    fields.update(kw)
    return agent_pb2.LaunchWorkersRequest(**fields)  # type: ignore[arg-type]


async def test_launch_logs_exit_report_and_list(agent: AgentApp, scheduler: Scheduler,
                                                agent_stub: agent_pb2_grpc.AgentServiceStub) -> None:
    # The scheduler launches the job through LaunchWorkers; the workers' exits reach it and end the job.
    code = "import os; print('rank', os.environ['RANK'], os.environ['GLOO_SOCKET_IFNAME'])"
    await scheduler.registered()
    job_id = await scheduler.submit([PY, "-c", code], gpus=2)
    job = await scheduler.job_in(job_id, types_pb2.JOB_STATE_SUCCEEDED)
    assert [(e.rank, e.node_id, e.exit_code, e.signal) for e in job.exits] == [(0, "node-a", 0, 0),
                                                                               (1, "node-a", 0, 0)]
    assert all(e.exited_at.seconds > 0 for e in job.exits)

    logs = await agent_stub.GetWorkerLogs(agent_pb2.GetWorkerLogsRequest(job_id=job_id))
    assert [(ln.rank, ln.stream, ln.text, ln.attempt) for ln in logs.lines] == [
        (0, "stdout", "rank 0 lo", job.attempt), (1, "stdout", "rank 1 lo", job.attempt)]

    listed = await agent_stub.ListWorkers(agent_pb2.ListWorkersRequest())
    assert sorted((w.rank, w.running, w.exit_code) for w in listed.workers) == [(0, False, 0), (1, False, 0)]
    pids = [w.pid for w in sorted(listed.workers, key=lambda w: w.rank)]
    again = await agent_stub.LaunchWorkers(launch_req(job_id, code, scheduler.epoch, ranks=2, attempt=job.attempt))
    assert again.already_running and list(again.pids) == pids

    assert agent.supervisor is not None
    path = agent.supervisor.jobs_root / job_id / f"attempt-{job.attempt}" / records.RECORD_NAME
    await until(lambda: all(w.reported for w in records.load(path).workers),  # type: ignore[union-attr]
                "the acknowledged exits to be marked reported")


async def test_stop_over_grpc(agent: AgentApp, agent_stub: agent_pb2_grpc.AgentServiceStub,
                              scheduler: Scheduler) -> None:
    # Workers of a job the scheduler placed (workers nobody placed would be stopped by the scheduler itself).
    await scheduler.registered()
    job_id = await scheduler.submit([PY, "-c", "import time; time.sleep(300)"], gpus=2)
    await scheduler.job_in(job_id, types_pb2.JOB_STATE_RUNNING)
    resp = await agent_stub.StopWorkers(agent_pb2.StopWorkersRequest(job_id=job_id, attempt=1,
                                                                      grace_period_ms=500, reason="cancel"))
    assert resp.stopped == 2
    listed = await agent_stub.ListWorkers(agent_pb2.ListWorkersRequest())
    assert {(w.running, w.signal, w.exit_code) for w in listed.workers if w.job_id == job_id} == {(False, 15, 143)}
    assert agent.supervisor is not None
    path = agent.supervisor.jobs_root / job_id / "attempt-1" / records.RECORD_NAME
    await until(lambda: [w.reported for w in records.load(path).workers] == [True, True],  # type: ignore[union-attr]
                "the stopped workers' exits to be acknowledged")
    job = await scheduler.job_in(job_id, types_pb2.JOB_STATE_FAILED)
    assert {(e.signal, e.exit_code) for e in job.exits} == {(15, 143)}
    assert (await agent_stub.StopWorkers(agent_pb2.StopWorkersRequest(job_id=job_id, attempt=1))).stopped == 0
    assert (await agent_stub.StopWorkers(agent_pb2.StopWorkersRequest(job_id="nope", attempt=1))).stopped == 0


async def test_stream_logs_follows_until_the_workers_exit(agent_stub: agent_pb2_grpc.AgentServiceStub,
                                                          scheduler: Scheduler) -> None:
    # The worker waits for the follower to attach (a gate file), so the stream sees lines as they come.
    import tempfile
    from pathlib import Path

    gate = Path(tempfile.mkdtemp()) / "go"
    code = (f"import os, time\nwhile not os.path.exists({str(gate)!r}):\n    time.sleep(0.01)\n"
            "for i in range(10):\n    print(i, flush=True)\n    time.sleep(0.05)\n")
    await scheduler.registered()
    job_id = await scheduler.submit([PY, "-c", code], gpus=1)
    await scheduler.job_in(job_id, types_pb2.JOB_STATE_RUNNING)
    texts: list[str] = []

    async def follow() -> None:
        async for chunk in agent_stub.StreamWorkerLogs(agent_pb2.GetWorkerLogsRequest(job_id=job_id)):
            texts.extend(ln.text for ln in chunk.lines)

    follower = asyncio.ensure_future(follow())
    gate.touch()
    await asyncio.wait_for(follower, timeout=20)
    assert texts == [str(i) for i in range(10)]


@pytest.mark.parametrize("call,code,message", [
    (lambda s, e: s.LaunchWorkers(launch_req("job-x", "pass", e, command=[])), grpc.StatusCode.INVALID_ARGUMENT,
     "command is empty"),
    (lambda s, e: s.LaunchWorkers(agent_pb2.LaunchWorkersRequest(
        job_id="job-x", attempt=1, command=["true"], leader_epoch=e,
        workers=[agent_pb2.WorkerSpec(rank=0, gpu_indices=[8])])),
     grpc.StatusCode.INVALID_ARGUMENT, "asks for GPU 8, but node node-a has GPUs 0-7"),
    (lambda s, e: s.LaunchWorkers(launch_req("job-x", "pass", e, working_dir="/no/such/dir")),
     grpc.StatusCode.INVALID_ARGUMENT, "working_dir /no/such/dir does not exist"),
    (lambda s, e: s.GetWorkerLogs(agent_pb2.GetWorkerLogsRequest(job_id="unknown-job")), grpc.StatusCode.NOT_FOUND,
     "job unknown-job has no workers on this node"),
    (lambda s, e: s.StreamWorkerLogs(agent_pb2.GetWorkerLogsRequest(job_id="unknown-job")).read(),
     grpc.StatusCode.NOT_FOUND, "no workers on this node"),
    (lambda s, e: s.StopWorkers(agent_pb2.StopWorkersRequest(job_id="j", attempt=1, grace_period_ms=-1)),
     grpc.StatusCode.INVALID_ARGUMENT, "grace_period_ms must be >= 0"),
    (lambda s, e: s.StopWorkers(agent_pb2.StopWorkersRequest(job_id="j", attempt=1, signal="SIGSEGV")),
     grpc.StatusCode.INVALID_ARGUMENT, "signal 'SIGSEGV' is not allowed; use one of SIGTERM"),
    (lambda s, e: s.InjectFault(agent_pb2.InjectFaultRequest(gpu_index=0, kind="meteor")),
     grpc.StatusCode.INVALID_ARGUMENT, "unknown fault kind 'meteor'"),
])
async def test_errors_map_to_status_codes(agent_stub: agent_pb2_grpc.AgentServiceStub, scheduler: Scheduler,
                                          call: object, code: grpc.StatusCode, message: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(agent_stub, scheduler.epoch)  # type: ignore[operator]
    assert info.value.code() == code and message in (info.value.details() or "")


async def test_a_stale_leader_is_refused_after_a_newer_epoch_was_seen(
        agent: AgentApp, agent_stub: agent_pb2_grpc.AgentServiceStub, scheduler: Scheduler) -> None:
    old = scheduler.epoch
    await until(lambda: agent.fence.highest == old, "the leader's epoch to reach the fence")
    await scheduler.restart()  # a new term of leadership: a larger epoch
    assert scheduler.epoch > old
    await until(lambda: agent.fence.highest == scheduler.epoch, "the heartbeat answers' new epoch to reach the fence")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await agent_stub.LaunchWorkers(launch_req("job-old-leader", "pass", old))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "stale scheduler leader" in (info.value.details() or "")


@pytest.mark.parametrize("scheduler_options", [{"heartbeat_interval_ms": 60_000, "node_timeout_s": 300.0,
                                                 "worker_fence_s": 310.0}])
async def test_injected_xid_reaches_the_scheduler_at_once(agent: AgentApp, scheduler: Scheduler,
                                                          agent_stub: agent_pb2_grpc.AgentServiceStub) -> None:
    # The scheduler asks for a beat a minute: only an immediate push can deliver the change in time.
    await until(lambda: agent.reporter is not None and agent.reporter.acked_seq >= 1, "the first heartbeat")
    assert agent.reporter is not None
    beats = agent.reporter.seq
    resp = await agent_stub.InjectFault(agent_pb2.InjectFaultRequest(gpu_index=3, kind="xid", xid=79))
    assert resp.gpu.index == 3 and resp.gpu.health == types_pb2.GPU_HEALTH_UNHEALTHY
    assert "fallen off the bus" in resp.gpu.health_reason

    async def gpu_3_unhealthy() -> types_pb2.Gpu | None:
        node = await scheduler.node()
        gpu = node.gpus[3] if node is not None else None
        return gpu if gpu is not None and gpu.health == types_pb2.GPU_HEALTH_UNHEALTHY else None

    gpu = await eventually(gpu_3_unhealthy, timeout=2.0, what="the scheduler to see GPU 3 unhealthy")
    assert "fallen off the bus" in gpu.health_reason and gpu.health_action == "reboot_host"
    assert agent.reporter.seq <= beats + 2
    # An application XID changes nothing.
    ok = await agent_stub.InjectFault(agent_pb2.InjectFaultRequest(gpu_index=1, kind="xid", xid=13))
    assert ok.gpu.health == types_pb2.GPU_HEALTH_HEALTHY


async def test_xid_79_on_a_running_jobs_gpu_cordons_the_node_and_evacuates_the_job(
        agent: AgentApp, scheduler: Scheduler, agent_stub: agent_pb2_grpc.AgentServiceStub) -> None:
    await scheduler.registered()
    job_id = await scheduler.submit([PY, "-c", "import time; time.sleep(300)"], gpus=4)
    job = await scheduler.job_in(job_id, types_pb2.JOB_STATE_RUNNING)
    (placed,) = job.placement
    assert agent.supervisor is not None
    assert sum(w.running for w in agent.supervisor.list_workers()) == 4
    victim = placed.gpu_indices[3]

    # An application error on one of the job's GPUs: nothing is drained, the job keeps running.
    app_error = await agent_stub.InjectFault(agent_pb2.InjectFaultRequest(gpu_index=placed.gpu_indices[2],
                                                                          kind="xid", xid=13))
    assert (app_error.gpu.health, app_error.gpu.health_action) == (types_pb2.GPU_HEALTH_HEALTHY, "none")
    node = await scheduler.node()
    assert node is not None and not node.cordoned and node.state == types_pb2.NODE_STATE_READY

    loop = asyncio.get_running_loop()
    injected = loop.time()
    await agent_stub.InjectFault(agent_pb2.InjectFaultRequest(gpu_index=victim, kind="xid", xid=79))

    async def gpu_unhealthy() -> types_pb2.Node | None:
        n = await scheduler.node()
        return n if n is not None and n.gpus[victim].health == types_pb2.GPU_HEALTH_UNHEALTHY else None

    seen = await eventually(gpu_unhealthy, timeout=2.0, interval=0.02,
                            what=f"the scheduler to see GPU {victim} unhealthy")
    assert loop.time() - injected <= 2.0
    assert seen.gpus[victim].health_action == "reboot_host"

    async def cordoned() -> types_pb2.Node | None:
        n = await scheduler.node()
        return n if n is not None and n.cordoned else None

    node = await eventually(cordoned, timeout=5.0, what="the node to be cordoned per policy")
    assert f"GPU {victim}" in node.cordon_reason
    await until(lambda: not any(w.running for w in agent.supervisor.list_workers()),  # type: ignore[union-attr]
                "the job's workers to be stopped")
    # Once the agent has confirmed the stop, the job restarts as an infrastructure failure (its restart
    # budget untouched) and waits: the only node is cordoned.
    waiting = await scheduler.job_in(job_id, types_pb2.JOB_STATE_PENDING)
    assert (waiting.attempt, waiting.infra_restarts, waiting.restarts) == (2, 1, 0)
    restarting = [e for e in waiting.events if e.kind == "restarting"]
    assert restarting and f"GPU {victim}" in restarting[-1].message


async def test_other_fault_kinds_reach_the_scheduler(agent: AgentApp, scheduler: Scheduler,
                                                     agent_stub: agent_pb2_grpc.AgentServiceStub) -> None:
    await scheduler.registered()
    ecc = await agent_stub.InjectFault(agent_pb2.InjectFaultRequest(gpu_index=1, kind="ecc", count=12))
    assert (ecc.gpu.health, ecc.gpu.health_action) == (types_pb2.GPU_HEALTH_UNHEALTHY, "reset_gpu")
    assert ecc.gpu.health_reason == "12 uncorrectable ECC errors (limit 10)"
    hot = await agent_stub.InjectFault(agent_pb2.InjectFaultRequest(gpu_index=2, kind="thermal", temperature_c=94))
    assert (hot.gpu.health, hot.gpu.health_action) == (types_pb2.GPU_HEALTH_DEGRADED, "none")
    lost = await agent_stub.InjectFault(agent_pb2.InjectFaultRequest(gpu_index=5, kind="fall_off_bus"))
    assert (lost.gpu.health, lost.gpu.health_action) == (types_pb2.GPU_HEALTH_UNHEALTHY, "reboot_host")

    async def seen() -> types_pb2.Node | None:
        n = await scheduler.node()
        ok = n is not None and [g.health for g in n.gpus][:6] == [
            types_pb2.GPU_HEALTH_HEALTHY, types_pb2.GPU_HEALTH_UNHEALTHY, types_pb2.GPU_HEALTH_HEALTHY,
            types_pb2.GPU_HEALTH_HEALTHY, types_pb2.GPU_HEALTH_HEALTHY, types_pb2.GPU_HEALTH_UNHEALTHY]
        # GPU 5's XID 79 and its silence may arrive in two pushes.
        return n if ok and "GpuIsLost" in n.gpus[5].health_reason else None

    await eventually(seen, what="the scheduler to see GPUs 1 and 5 unhealthy (degraded is schedulable)")
    # The lost GPU's metrics are missing from the beats; the others' counters travel with them.
    assert agent.monitor is not None
    metrics = {m.index: m for m in agent.monitor.latest}
    assert 5 not in metrics and metrics[1].counters.ecc_volatile_uncorrected == 12
    assert metrics[2].temperature_c == 94 and "hw_thermal" in metrics[2].throttle_reasons


async def test_a_stop_from_a_stale_leader_is_refused(agent: AgentApp, scheduler: Scheduler,
                                                     agent_stub: agent_pb2_grpc.AgentServiceStub) -> None:
    await until(lambda: agent.fence.highest == scheduler.epoch, "the leader's epoch to reach the fence")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await agent_stub.StopWorkers(agent_pb2.StopWorkersRequest(job_id="j", attempt=1,
                                                                  leader_epoch=scheduler.epoch - 1))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "stale scheduler leader" in (info.value.details() or "")
    # The current leader, and an operator's unfenced call (epoch 0), are served.
    ok = await agent_stub.StopWorkers(agent_pb2.StopWorkersRequest(job_id="j", attempt=1, leader_epoch=scheduler.epoch))
    assert ok.stopped == 0
    assert (await agent_stub.StopWorkers(agent_pb2.StopWorkersRequest(job_id="j", attempt=1))).stopped == 0
