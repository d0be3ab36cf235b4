"""The scheduler against a real etcd and real gRPC servers on port 0, with a real node agent on simulated
GPUs (fake NVML): submission to success, input errors, leader election, fencing."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from pathlib import Path

import grpc
import grpc.aio
import pytest

from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_agent.app import AgentApp
from trainyard_agent.settings import AgentSettings
from trainyard_core.errors import Conflict
from trainyard_core.store import Compare
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.store.etcd_options import EtcdOptions
from trainyard_core.testing.etcd_secure import settings_of
from trainyard_core.testing.wait import eventually, truthy
from trainyard_scheduler.app import SchedulerApp
from trainyard_scheduler.domain.models import Allocation, JobState
from trainyard_scheduler.settings import SchedulerSettings
from trainyard_scheduler.state.repository import Repository


def sched_settings(etcd: Mapping[str, str], prefix: str) -> SchedulerSettings:
    return SchedulerSettings(**etcd, etcd_prefix=prefix, listen_port=0, leader_ttl_s=2,
                             reconcile_interval_s=0.2, stop_grace_s=1.0, node_timeout_s=3.0)


@pytest.fixture
async def leader(etcd_settings: dict[str, str], key_prefix: str) -> AsyncIterator[SchedulerApp]:
    app = SchedulerApp(sched_settings(etcd_settings, key_prefix.rstrip("/")))
    await app.start()
    await eventually(lambda: truthy(app.leadership.is_leader), what="first replica leads")
    yield app
    await app.stop()


@pytest.fixture
async def agent(leader: SchedulerApp, tmp_path: Path) -> AsyncIterator[AgentApp]:
    settings = AgentSettings(node_id="node-a", gpu_profile="a100x4", scheduler_address=f"127.0.0.1:{leader.grpc_port}",
                             state_dir=str(tmp_path / "agent"), heartbeat_interval_s=0.2, stop_grace_s=1.0,
                             single_tenant=True)
    app = AgentApp(settings)
    await app.start()
    yield app
    await app.stop(kill_workers=True)


def job_service(app: SchedulerApp) -> scheduler_pb2_grpc.JobServiceStub:
    return scheduler_pb2_grpc.JobServiceStub(grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}"))


def spec(command: list[str], nodes: int = 1, gpus: int = 1) -> types_pb2.JobSpec:
    return types_pb2.JobSpec(name="it", command=command,
                             resources=types_pb2.Resources(nodes=nodes, gpus_per_node=gpus))


async def wait_state(stub: scheduler_pb2_grpc.JobServiceStub, job_id: str, state: int) -> types_pb2.Job:
    async def probe() -> types_pb2.Job | None:
        job = (await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id))).job
        return job if job.state == state else None

    return await eventually(probe, timeout=30, what=f"job {job_id} in state {state}")


async def test_job_runs_to_success_and_gpus_are_released(leader: SchedulerApp, agent: AgentApp) -> None:
    stub = job_service(leader)
    await eventually(lambda: _nodes(leader), what="node registered")
    sub = await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(
        spec=spec([sys.executable, "-c", "print('hi')"], gpus=4), team="team-a", user="ann"))
    job = await wait_state(stub, sub.job.id, types_pb2.JOB_STATE_SUCCEEDED)
    assert [e.rank for e in job.exits] == [0, 1, 2, 3] and job.team == "team-a"
    repo = Repository(leader.store, leader.keys)
    assert await repo.get_allocation(sub.job.id) is None  # released with the terminal state


async def _nodes(app: SchedulerApp) -> bool:
    return bool(await Repository(app.store, app.keys).nodes.list())


async def test_bad_submissions_change_nothing_in_etcd(leader: SchedulerApp, agent: AgentApp, key_prefix: str) -> None:
    stub = job_service(leader)
    await eventually(lambda: _nodes(leader), what="node registered")
    store = EtcdStore.from_options(leader.settings.etcd_options())
    before = [(kv.key, kv.mod_revision) for kv in (await store.range(key_prefix + "jobs/")).kvs]
    cases = [
        (spec([]), "command must not be empty"),
        (spec(["x"], nodes=0), "resources.nodes"),
        (spec(["x"], gpus=-1), "resources.gpus_per_node"),
        (spec(["x"], gpus=5), "more than any node has"),
    ]
    for bad, message in cases:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=bad))
        # A spec the fleet cannot hold is well-formed: FAILED_PRECONDITION; the others break the contract.
        fits_not = message == "more than any node has"
        assert info.value.code() == (grpc.StatusCode.FAILED_PRECONDITION if fits_not
                                     else grpc.StatusCode.INVALID_ARGUMENT)
        assert message in (info.value.details() or "")
    after = [(kv.key, kv.mod_revision) for kv in (await store.range(key_prefix + "jobs/")).kvs]
    assert before == after
    with pytest.raises(grpc.aio.AioRpcError) as nf:
        await stub.GetJob(scheduler_pb2.GetJobRequest(job_id="job-doesnotexist"))
    assert nf.value.code() == grpc.StatusCode.NOT_FOUND
    await store.close()


async def test_other_teams_jobs_are_invisible(leader: SchedulerApp) -> None:
    stub = job_service(leader)
    sub = await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec(["true"]), team="team-a"))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=sub.job.id, team="team-b"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    listed = await stub.ListJobs(scheduler_pb2.ListJobsRequest(team="team-b"))
    assert sub.job.id not in [j.id for j in listed.jobs]
    cancelled = await stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=sub.job.id, team="team-a"))
    assert cancelled.job.state == types_pb2.JOB_STATE_CANCELLED  # pending: cancelled at once


async def test_standby_takes_over_and_the_old_epoch_is_fenced(leader: SchedulerApp, etcd_settings: dict[str, str],
                                                              key_prefix: str) -> None:
    standby = SchedulerApp(sched_settings(etcd_settings, key_prefix.rstrip("/")))
    await standby.start()
    try:
        assert not standby.leadership.is_leader
        nodes = scheduler_pb2_grpc.NodeServiceStub(grpc.aio.insecure_channel(f"127.0.0.1:{standby.grpc_port}"))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await nodes.RegisterNode(scheduler_pb2.RegisterNodeRequest(node=types_pb2.Node(node_id="node-x")))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "not the leader" in (info.value.details() or "")

        old_epoch = leader.leadership.epoch
        sub = await job_service(leader).SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec(["true"])))
        await leader.stop()  # resigns: the standby should not wait for the lease to expire
        await eventually(lambda: truthy(standby.leadership.is_leader), timeout=5, what="standby leads")
        assert standby.leadership.epoch > old_epoch

        # A write fenced with the old epoch can never land.
        stale = Repository(standby.store, standby.keys,
                           fence=lambda: Compare(standby.keys.leader, "create", "==", old_epoch))
        found = await stale.get_job(sub.job.id)
        assert found is not None and found[0].state is JobState.PENDING
        alloc = Allocation(job_id=sub.job.id, attempt=0, assignments=(), master_addr="x", master_port=1,
                           created_at=0.0)
        with pytest.raises(Conflict):
            await stale.commit_placement(found[0], found[1], alloc)
    finally:
        await standby.stop()


async def test_metrics_count_placements_and_are_served(leader: SchedulerApp, agent: AgentApp) -> None:
    import httpx

    from trainyard_core.telemetry import start_metrics_server
    from trainyard_scheduler import metrics

    before = metrics.GANGS_PLACED._value.get()
    stub = job_service(leader)
    await eventually(lambda: _nodes(leader), what="node registered")
    sub = await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec([sys.executable, "-c", "pass"])))
    await wait_state(stub, sub.job.id, types_pb2.JOB_STATE_SUCCEEDED)
    assert metrics.GANGS_PLACED._value.get() == before + 1
    port = start_metrics_server("127.0.0.1", 0)
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
    assert "trainyard_scheduler_gangs_placed_total" in text
    assert 'trainyard_scheduler_jobs_finished_total{state="succeeded"}' in text


async def test_exits_reported_after_the_gang_was_released_still_land_on_the_job(leader: SchedulerApp) -> None:
    from trainyard_scheduler.domain.models import WorkerExit

    repo = Repository(leader.store, leader.keys)
    stub = job_service(leader)
    sub = await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec(["true"])))
    # The leader may be writing the job's "why pending" message meanwhile: read-modify-write until it lands.
    async def finish() -> bool:
        found = await repo.get_job(sub.job.id)
        assert found is not None
        job, rev = found
        try:
            await repo.update_job(replace(job, state=JobState.FAILED, exits=(WorkerExit(0, "node-a", 3, 0, 1.0),)),
                                  rev)
        except Conflict:
            return False
        return True
    await eventually(finish, what="job marked failed")
    job = (await repo.get_job(sub.job.id) or (None, 0))[0]
    assert job is not None
    late = WorkerExit(1, "node-a", 143, 15, 2.0)
    assert job.attempt == 1  # attempts count from 1
    assert await repo.exits.record(job.id, 1, late)
    assert await repo.exits.record(job.id, 1, late)  # idempotent
    assert not await repo.exits.record(job.id, 2, late)  # another attempt: not this job's
    final = await repo.get_job(job.id)
    assert final is not None and [(e.rank, e.exit_code) for e in final[0].exits] == [(0, 3), (1, 143)]


async def test_scheduler_answers_unavailable_when_etcd_dies() -> None:
    """Regression: after etcd died, closing the broken client waited on aetcd's watch stream, so
    GetJob hung past any client deadline instead of answering UNAVAILABLE."""
    from trainyard_core.testing import etcd as etcd_proc

    member = etcd_proc.start_single()
    app = SchedulerApp(sched_settings(settings_of(EtcdOptions(endpoints=member.endpoint)), "/dying"))
    await app.start()
    try:
        # Straight after start, while the election and the mirror's watch are busy: the window where the
        # hang showed up.
        etcd_proc.stop_and_clean(member)
        stub = job_service(app)
        for _ in range(3):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.GetJob(scheduler_pb2.GetJobRequest(job_id="job-gone"), timeout=20)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
    finally:
        etcd_proc.stop_and_clean(member)
        await asyncio.wait_for(app.stop(), 20)


async def test_workers_no_allocation_accounts_for_are_stopped(leader: SchedulerApp, agent: AgentApp) -> None:
    """A node declared lost has its gang released; when it comes back still running those workers, the
    scheduler stops them and places nothing on the node meanwhile (no GPU in two gangs)."""
    from trainyard_core.store import Delete

    repo = Repository(leader.store, leader.keys)
    stub = job_service(leader)
    await eventually(lambda: _nodes(leader), what="node registered")
    sub = await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(
        spec=spec([sys.executable, "-c", "import time; time.sleep(600)"], gpus=4)))
    await wait_state(stub, sub.job.id, types_pb2.JOB_STATE_RUNNING)
    assert agent.supervisor is not None

    # A returning node reports what it runs in the same message that makes it alive again.
    await eventually(lambda: truthy((sub.job.id, 1) in leader.liveness.reports.running().get("node-a", ())),
                     what="agent reported the job running")
    # The state a lost node leaves behind: the job finished as FAILED, its allocation gone.
    found = await repo.get_job(sub.job.id)
    assert found is not None
    job, rev = found
    await leader.store.txn([], [Delete(leader.keys.allocation(job.id))])
    await repo.update_job(replace(job, state=JobState.FAILED, message="node node-a lost contact"), rev)

    waiting = await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec([sys.executable, "-c", "pass"], gpus=4)))

    async def stray_gone() -> bool:
        assert agent.supervisor is not None
        return not any(w.job_id == job.id and w.running for w in agent.supervisor.list_workers())

    await eventually(stray_gone, timeout=20, what="stray workers stopped")
    # Only then does the node take the next gang: it never shared the GPUs with the strays.
    done = await wait_state(stub, waiting.job.id, types_pb2.JOB_STATE_SUCCEEDED)
    assert done.started_at.ToNanoseconds() > 0


async def test_agent_follows_the_leader_across_a_failover(etcd_settings: dict[str, str], key_prefix: str,
                                                          tmp_path: Path) -> None:
    """Two replicas; the agent knows both. The leader stops: the standby takes over, the agent registers
    with it, and a job submitted to the new leader runs on the agent."""
    prefix = key_prefix.rstrip("/")
    first = SchedulerApp(SchedulerSettings(**{**sched_settings(etcd_settings, prefix).model_dump(),
                                              "heartbeat_interval_ms": 200}))
    await first.start()
    await eventually(lambda: truthy(first.leadership.is_leader), what="first replica leads")
    second = SchedulerApp(SchedulerSettings(**{**sched_settings(etcd_settings, prefix).model_dump(),
                                               "heartbeat_interval_ms": 200}))
    await second.start()
    agent = AgentApp(AgentSettings(node_id="node-a", gpu_profile="a100x4", state_dir=str(tmp_path / "agent"),
                                   scheduler_address=f"127.0.0.1:{second.grpc_port},127.0.0.1:{first.grpc_port}",
                                   stop_grace_s=1.0, reconnect_initial_s=0.05, reconnect_max_s=0.3,
                                   single_tenant=True))
    await agent.start()
    try:
        await eventually(lambda: truthy(agent.reporter is not None and agent.reporter.connected),
                         what="agent connected to the leader (after trying the standby)")
        await first.stop()
        await eventually(lambda: truthy(second.leadership.is_leader), timeout=5, what="standby leads")
        await eventually(lambda: truthy("node-a" in second.liveness.alive(["node-a"])
                                       and second.liveness.last_seen_age("node-a") is not None),
                         timeout=10, what="agent heartbeating to the new leader")
        stub = job_service(second)
        sub = await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec([sys.executable, "-c", "pass"])))
        await wait_state(stub, sub.job.id, types_pb2.JOB_STATE_SUCCEEDED)
    finally:
        await agent.stop(kill_workers=True)
        await second.stop()
        await first.stop()
