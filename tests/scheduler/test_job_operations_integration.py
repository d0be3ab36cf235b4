"""The job operations through the real JobService (gRPC on port 0, real etcd, the leader's reconcile loop) and a
real node agent on simulated GPUs: a held job is passed over while GPUs are free and placed once released, from
its original place; a requeued running job is stopped with its own preemption signal and runs again as a new
attempt; a priority change reaches a running gang's standing; refusals are FAILED_PRECONDITION / NOT_FOUND."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
import pytest

from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2 as sc
from trainyard.scheduler.v1 import scheduler_pb2_grpc
from trainyard_agent.app import AgentApp
from trainyard_agent.settings import AgentSettings
from trainyard_core.testing.wait import eventually
from trainyard_scheduler.app import SchedulerApp
from trainyard_scheduler.settings import SchedulerSettings
from trainyard_scheduler.state.repository import Repository

PENDING, RUNNING, SUCCEEDED = types_pb2.JOB_STATE_PENDING, types_pb2.JOB_STATE_RUNNING, types_pb2.JOB_STATE_SUCCEEDED


@pytest.fixture
async def leader(etcd_settings: dict[str, str], key_prefix: str) -> AsyncIterator[SchedulerApp]:
    app = SchedulerApp(SchedulerSettings(**etcd_settings, etcd_prefix=key_prefix.rstrip("/"), listen_port=0,
                                         leader_ttl_s=2, reconcile_interval_s=0.2, stop_grace_s=1.0,
                                         node_timeout_s=3.0))
    await app.start()

    async def leads() -> bool:
        return app.leadership.is_leader

    await eventually(leads, what="the replica to lead")
    yield app
    await app.stop()


@pytest.fixture
async def stub(leader: SchedulerApp) -> AsyncIterator[scheduler_pb2_grpc.JobServiceStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{leader.grpc_port}") as channel:
        yield scheduler_pb2_grpc.JobServiceStub(channel)


async def _agent(leader: SchedulerApp, state_dir: Path) -> AgentApp:
    app = AgentApp(AgentSettings(node_id="node-a", gpu_profile="a100x4",
                                 scheduler_address=f"127.0.0.1:{leader.grpc_port}", state_dir=str(state_dir),
                                 heartbeat_interval_s=0.2, stop_grace_s=1.0, single_tenant=True))
    await app.start()

    async def registered() -> bool:
        return bool(await Repository(leader.store, leader.keys).nodes.list())

    await eventually(registered, what="the node to register")
    return app


def _spec(command: list[str], name: str = "op", gpus: int = 1, **more: object) -> types_pb2.JobSpec:
    return types_pb2.JobSpec(name=name, command=command, resources=types_pb2.Resources(nodes=1, gpus_per_node=gpus),
                             **more)  # type: ignore[arg-type]


async def _submit(stub: scheduler_pb2_grpc.JobServiceStub, spec: types_pb2.JobSpec, team: str = "team-a",
                  user: str = "ann") -> types_pb2.Job:
    return (await stub.SubmitJob(sc.SubmitJobRequest(spec=spec, team=team, user=user))).job


async def _get(stub: scheduler_pb2_grpc.JobServiceStub, job_id: str) -> types_pb2.Job:
    return (await stub.GetJob(sc.GetJobRequest(job_id=job_id))).job


async def _until(stub: scheduler_pb2_grpc.JobServiceStub, job_id: str, state: int, attempt: int = 0,
                 timeout: float = 30) -> types_pb2.Job:
    async def probe() -> types_pb2.Job | None:
        job = await _get(stub, job_id)
        return job if job.state == state and (not attempt or job.attempt == attempt) else None

    return await eventually(probe, timeout=timeout, what=f"job {job_id} in state {state} (attempt {attempt or 'any'})")


async def test_a_held_job_is_passed_over_while_gpus_are_free_and_placed_once_released(
        leader: SchedulerApp, stub: scheduler_pb2_grpc.JobServiceStub, tmp_path: Path) -> None:
    # Submitted and held before any node exists, so nothing could have placed it first.
    held_spec = _spec([sys.executable, "-c", "print('held ran')"], name="held")
    first = await _submit(stub, held_spec)
    held = (await stub.HoldJob(sc.HoldJobRequest(job_id=first.id, team="team-a", user="ann",
                                                 reason="dataset not ready"))).job
    assert (held.state, held.held_by, held.hold_reason) == (PENDING, "ann", "dataset not ready")
    again = (await stub.HoldJob(sc.HoldJobRequest(job_id=first.id, team="team-a", user="bob"))).job
    assert again.held_by == "ann" and again.updated_at == held.updated_at  # idempotent: nothing written
    agent = await _agent(leader, tmp_path / "agent")
    try:
        # A younger job of the same size runs to its end on the free GPUs: the cycles that placed it passed the
        # older, held one over.
        witness = await _submit(stub, _spec([sys.executable, "-c", "print('witness')"], name="witness"))
        await _until(stub, witness.id, SUCCEEDED)
        still = await _get(stub, first.id)
        assert (still.state, still.held_by, still.attempt, list(still.placement)) == (PENDING, "ann", 1, [])
        assert still.message == "held by ann: dataset not ready; not placed until released"

        released = (await stub.ReleaseJob(sc.ReleaseJobRequest(job_id=first.id, team="team-a", user="ann"))).job
        assert (released.held_by, released.queued_at) == ("", first.queued_at)  # its original place
        done = await _until(stub, first.id, SUCCEEDED)
        assert [e.kind for e in done.events][:3] == ["held", "released", "admitted"]
        assert done.queued_at == first.queued_at
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.HoldJob(sc.HoldJobRequest(job_id=first.id, team="team-a", user="ann"))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "is succeeded: only a pending job can be held" in (refused.value.details() or "")
    finally:
        await agent.stop(kill_workers=True)


# A worker that marks its start, and on SIGUSR1 (its preemption signal) marks that and exits 0.
WORKER = """
import os, pathlib, signal, sys, time
d = pathlib.Path(sys.argv[1]); attempt = os.environ["TRAINYARD_ATTEMPT"]
def stop(*_):
    (d / f"attempt-{attempt}.signalled").write_text("SIGUSR1")
    sys.exit(0)
signal.signal(signal.SIGUSR1, stop)
(d / f"attempt-{attempt}.started").write_text("")
time.sleep(600)
"""


async def test_a_requeued_running_job_is_stopped_with_its_signal_and_runs_again_as_a_new_attempt(
        leader: SchedulerApp, stub: scheduler_pb2_grpc.JobServiceStub, tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    agent = await _agent(leader, tmp_path / "agent")
    try:
        job = await _submit(stub, _spec([sys.executable, "-c", WORKER, str(marks)], name="requeued", max_restarts=0,
                                        preemption=types_pb2.PreemptionPolicy(signal="SIGUSR1", grace_s=20)))
        await _until(stub, job.id, RUNNING, attempt=1)
        await eventually(lambda: _exists(marks / "attempt-1.started"), timeout=30, what="attempt 1 to start")

        asked = (await stub.RequeueJob(sc.RequeueJobRequest(job_id=job.id, team="team-a", user="ann",
                                                           reason="picked up new data"))).job
        assert asked.requeue_requested_by == "ann"
        running = await _until(stub, job.id, RUNNING, attempt=2)
        assert (marks / "attempt-1.signalled").read_text() == "SIGUSR1"  # its own signal, within its grace
        assert (running.restarts, running.infra_restarts, running.requeue_requested_by) == (0, 0, "")
        [first] = running.attempts
        assert (first.attempt, first.outcome, first.reason) == (1, PENDING, "requeued by ann")
        kinds = [e.kind for e in running.events]
        assert kinds.index("requeue_requested") < kinds.index("pending") < len(kinds) - 1
        assert any(e.message == "requeue requested by ann: picked up new data" for e in running.events)

        # A priority change reaches the running gang's standing (what preemption compares).
        changed = (await stub.SetJobPriority(sc.SetJobPriorityRequest(job_id=job.id, team="team-a", user="ann",
                                                                      priority=-7))).job
        assert changed.spec.priority == -7 and changed.events[-1].message == "priority 0 -> -7 by ann"
        repo = Repository(leader.store, leader.keys)

        async def restood() -> bool:
            found = await repo.get_allocation(job.id)
            return found is not None and found[0].priority[2] == -7

        await eventually(restood, what="the gang's standing to follow the priority")
        await stub.CancelJob(sc.CancelJobRequest(job_id=job.id, team="team-a", user="ann"))
    finally:
        await agent.stop(kill_workers=True)


async def _exists(path: Path) -> bool:
    return await asyncio.to_thread(path.exists)


async def test_refusals_and_team_scope(stub: scheduler_pb2_grpc.JobServiceStub) -> None:
    job = await _submit(stub, _spec(["true"]))
    cases: list[tuple[object, grpc.StatusCode, str]] = [
        (stub.HoldJob(sc.HoldJobRequest(job_id=job.id, team="team-b")), grpc.StatusCode.NOT_FOUND, "not found"),
        (stub.RequeueJob(sc.RequeueJobRequest(job_id=job.id, team="team-a")), grpc.StatusCode.FAILED_PRECONDITION,
         "only an admitted or running job can be requeued"),
        (stub.SetJobPriority(sc.SetJobPriorityRequest(job_id=job.id, priority=5000)),
         grpc.StatusCode.INVALID_ARGUMENT, "priority must be between"),
        (stub.HoldJob(sc.HoldJobRequest(job_id=job.id, reason="x" * 2000)), grpc.StatusCode.INVALID_ARGUMENT,
         "reason must be at most"),
        (stub.ReleaseJob(sc.ReleaseJobRequest(job_id="not an id")), grpc.StatusCode.INVALID_ARGUMENT,
         "not a valid job id"),
    ]
    for call, code, words in cases:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call  # type: ignore[misc]
        assert info.value.code() == code and words in (info.value.details() or ""), words
    # Released without a hold, and the same priority: nothing changes.
    same = (await stub.ReleaseJob(sc.ReleaseJobRequest(job_id=job.id, team="team-a", user="ann"))).job
    assert same.updated_at == job.updated_at
    await stub.CancelJob(sc.CancelJobRequest(job_id=job.id, team="team-a", user="ann"))
    with pytest.raises(grpc.aio.AioRpcError) as finished:
        await stub.SetJobPriority(sc.SetJobPriorityRequest(job_id=job.id, priority=1))
    assert finished.value.code() == grpc.StatusCode.FAILED_PRECONDITION
