"""The scheduler over mTLS: its certificate must name the scheduler, it launches on agents only over channels
that verify the agent is the node it means, and a job runs end to end with every call authenticated."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from pathlib import Path

import grpc
import grpc.aio
import pytest

from tests.scheduler.builders import make_node
from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_agent.app import AgentApp
from trainyard_agent.settings import AgentSettings
from trainyard_core.errors import Unavailable
from trainyard_core.files import atomic_write_bytes
from trainyard_core.rpc.server import secure_channel
from trainyard_core.security import identity, pki
from trainyard_core.security.pki import CertFiles
from trainyard_core.security.tls import ClientTls
from trainyard_core.service import check_transport
from trainyard_core.testing.etcd import free_port
from trainyard_core.testing.wait import eventually
from trainyard_scheduler.app import SchedulerApp
from trainyard_scheduler.grpc.agent_client import GrpcAgents
from trainyard_scheduler.settings import SchedulerSettings

NODE_1, NODE_2, OPS = identity.node("node-1"), identity.node("node-2"), identity.tool("ops")




def sched_settings(etcd: Mapping[str, str], prefix: str, files: CertFiles) -> SchedulerSettings:
    return SchedulerSettings.model_validate(dict(
        **etcd, etcd_prefix=prefix, listen_port=0, leader_ttl_s=2, reconcile_interval_s=0.2,
        stop_grace_s=1.0, node_timeout_s=3.0, tool_teams=["ops:team-a"], **files.settings()))


def agent_settings(tmp_path: Path, node_id: str, scheduler_address: str, files: CertFiles) -> AgentSettings:
    return AgentSettings.model_validate(dict(
        node_id=node_id, gpu_profile="a100x4", scheduler_address=scheduler_address,
        state_dir=str(tmp_path / f"agent-{node_id}"), heartbeat_interval_s=0.2, stop_grace_s=1.0, single_tenant=True,
        **files.settings()))


@pytest.fixture
async def leader(etcd_settings: dict[str, str], key_prefix: str, pki_dir: Path) -> AsyncIterator[SchedulerApp]:
    app = SchedulerApp(sched_settings(etcd_settings, key_prefix.rstrip("/"),
                                      pki.files_for(pki_dir, identity.SCHEDULER)))
    await app.start()

    async def leads() -> bool:
        return app.leadership.is_leader

    await eventually(leads, what="the scheduler to lead")
    yield app
    await app.stop()


def test_scheduler_certificate_must_name_the_scheduler(pki_dir: Path) -> None:
    assert check_transport(sched_settings({"etcd_endpoints": "127.0.0.1:1"}, "/p",
                                           pki.files_for(pki_dir, identity.SCHEDULER))) == ""
    problem = check_transport(sched_settings({"etcd_endpoints": "127.0.0.1:1"}, "/p", pki.files_for(pki_dir, NODE_1)))
    assert "names trainyard://node/node-1, but this service is trainyard://scheduler" in problem


async def test_job_runs_over_mtls(leader: SchedulerApp, tmp_path: Path, pki_dir: Path) -> None:
    agent = AgentApp(agent_settings(tmp_path, "node-1", f"127.0.0.1:{leader.grpc_port}",
                                    pki.files_for(pki_dir, NODE_1)))
    await agent.start()
    try:
        async with secure_channel(f"127.0.0.1:{leader.grpc_port}", ClientTls(pki.files_for(pki_dir, OPS)),
                                  identity.SCHEDULER) as ch:
            jobs = scheduler_pb2_grpc.JobServiceStub(ch)
            nodes = scheduler_pb2_grpc.NodeServiceStub(ch)

            async def registered() -> bool:
                return len((await nodes.ListNodes(scheduler_pb2.ListNodesRequest())).nodes) == 1

            await eventually(registered, what="node-1 registered")
            sub = await jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(
                spec=types_pb2.JobSpec(name="tls", command=[sys.executable, "-c", "print('hi')"],
                                       resources=types_pb2.Resources(nodes=1, gpus_per_node=4)),
                team="team-a", user="ann"))

            async def succeeded() -> types_pb2.Job | None:
                job = (await jobs.GetJob(scheduler_pb2.GetJobRequest(job_id=sub.job.id, team="team-a"))).job
                return job if job.state == types_pb2.JOB_STATE_SUCCEEDED else None

            job = await eventually(succeeded, timeout=30, what="the job to succeed")
            assert job.user == "tool:ops"  # a tool is its own user, whatever the request says
            # The launch reached the agent (LaunchWorkers from the scheduler's certificate), and the exits
            # came back (ReportWorkerExit from node-1's).
            assert [e.rank for e in job.exits] == [0, 1, 2, 3]
    finally:
        await agent.stop(kill_workers=True)


async def test_grpc_agents_verify_the_node_they_call(tmp_path: Path, pki_dir: Path) -> None:
    agent = AgentApp(agent_settings(tmp_path, "node-1", f"127.0.0.1:{free_port()}", pki.files_for(pki_dir, NODE_1)))
    await agent.start()
    agents = GrpcAgents(pki.files_for(pki_dir, identity.SCHEDULER), call_timeout_s=3)
    try:
        node_1 = replace(make_node("node-1"), agent_address=f"127.0.0.1:{agent.grpc_port}")
        await agents.stop(node_1, "job-x", 1, 0.0, "test", epoch=5)
        assert agent.fence.highest == 5
        # Another node's id at this address: the agent's certificate names node-1, so the call never leaves.
        node_2 = replace(node_1, node_id="node-2")
        with pytest.raises(Unavailable):
            await agents.stop(node_2, "job-x", 1, 0.0, "test", epoch=6)
        assert agent.fence.highest == 5
    finally:
        await agents.close()
        await agent.stop(kill_workers=True)


async def test_grpc_agents_without_tls_cannot_reach_a_tls_agent(tmp_path: Path, pki_dir: Path) -> None:
    agent = AgentApp(agent_settings(tmp_path, "node-1", f"127.0.0.1:{free_port()}", pki.files_for(pki_dir, NODE_1)))
    await agent.start()
    agents = GrpcAgents(None, call_timeout_s=2)
    try:
        node_1 = replace(make_node("node-1"), agent_address=f"127.0.0.1:{agent.grpc_port}")
        with pytest.raises(Unavailable):
            await agents.stop(node_1, "job-x", 1, 0.0, "test", epoch=5)
        assert agent.fence.highest == 0
    finally:
        await agents.close()
        await agent.stop(kill_workers=True)


async def test_plaintext_grpc_agents_take_node_ids_no_certificate_can_name() -> None:
    agents = GrpcAgents(None, call_timeout_s=1)
    try:
        node = replace(make_node("node-"), agent_address=f"127.0.0.1:{free_port()}")
        with pytest.raises(Unavailable):  # nobody listens: the call was made, not refused for the name
            await agents.stop(node, "job-x", 1, 0.0, "test", epoch=1)
    finally:
        await agents.close()



async def test_a_tool_acts_only_for_the_teams_it_is_bound_to(leader: SchedulerApp, pki_dir: Path) -> None:
    """tool/ops is bound to team-a (tool_teams=["ops:team-a"]): it may submit and read there; submitting for
    team-b, naming no team, or reading every team's jobs is refused with the principal and its teams named."""
    spec = types_pb2.JobSpec(name="t", command=["true"], resources=types_pb2.Resources(nodes=1, gpus_per_node=1))
    async with secure_channel(f"127.0.0.1:{leader.grpc_port}", ClientTls(pki.files_for(pki_dir, OPS)),
                              identity.SCHEDULER) as ch:
        jobs = scheduler_pb2_grpc.JobServiceStub(ch)
        for team in ("team-b", ""):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec, team=team, user="mallory"))
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "trainyard://tool/ops" in (err.value.details() or "")
            assert "team-a" in (err.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await jobs.ListJobs(scheduler_pb2.ListJobsRequest())
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        listed = await jobs.ListJobs(scheduler_pb2.ListJobsRequest(team="team-a"))
        assert list(listed.jobs) == []
    # A tool bound to no team may not touch JobService at all.
    other = identity.tool("other")
    pki.ensure(pki_dir, [other])
    async with secure_channel(f"127.0.0.1:{leader.grpc_port}", ClientTls(pki.files_for(pki_dir, other)),
                              identity.SCHEDULER) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await scheduler_pb2_grpc.JobServiceStub(ch).GetJob(
                scheduler_pb2.GetJobRequest(job_id="job-0000000000abcdefgh", team="team-a"))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "none" in (err.value.details() or "")


@pytest.mark.parametrize("pair", ["ops", "ops:", "Ops:team-a", "ops:Team_A"])
def test_tool_team_bindings_are_validated(pair: str) -> None:
    with pytest.raises(ValueError, match="TOOL:TEAM"):
        SchedulerSettings.model_validate({"tool_teams": [pair]})


async def test_certificates_rotated_while_a_job_runs_change_nothing_for_it(
        etcd_settings: dict[str, str], key_prefix: str, tmp_path: Path, pki_dir: Path) -> None:
    """Every leaf (scheduler, node-1, the tool) is re-issued and replaced on disk while a job runs: nothing
    restarts, the job finishes with no restart, and new connections made after the rotation work."""
    live = tmp_path / "live"
    live.mkdir()
    for principal in (identity.SCHEDULER, NODE_1, OPS):
        src = pki.files_for(pki_dir, principal)
        dst = pki.files_for(live, principal)
        for a, b in ((src.cert, dst.cert), (src.key, dst.key), (src.ca, dst.ca)):
            b.write_bytes(a.read_bytes())
    app = SchedulerApp(sched_settings(etcd_settings, key_prefix.rstrip("/"), pki.files_for(live, identity.SCHEDULER)))
    await app.start()
    agent = AgentApp(agent_settings(tmp_path, "node-1", f"127.0.0.1:{app.grpc_port}", pki.files_for(live, NODE_1)))
    await agent.start()
    try:
        async with secure_channel(f"127.0.0.1:{app.grpc_port}", ClientTls(pki.files_for(live, OPS)),
                                  identity.SCHEDULER) as ch:
            jobs = scheduler_pb2_grpc.JobServiceStub(ch)
            nodes = scheduler_pb2_grpc.NodeServiceStub(ch)

            async def registered() -> bool:
                if not app.leadership.is_leader:
                    return False
                return len((await nodes.ListNodes(scheduler_pb2.ListNodesRequest())).nodes) == 1

            await eventually(registered, what="node-1 registered with the leader")
            sub = await jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(
                spec=types_pb2.JobSpec(name="rot", command=[sys.executable, "-c", "import time; time.sleep(3)"],
                                       resources=types_pb2.Resources(nodes=1, gpus_per_node=4)), team="team-a"))

            async def state() -> int:
                return (await jobs.GetJob(scheduler_pb2.GetJobRequest(job_id=sub.job.id, team="team-a"))).job.state

            async def running() -> bool:
                return await state() == types_pb2.JOB_STATE_RUNNING
            await eventually(running, timeout=20, what="the job running")
            ca = pki._load_ca(pki_dir)
            for principal in (identity.SCHEDULER, NODE_1, OPS):
                cert, key = pki.issue(*ca, principal)
                files = pki.files_for(live, principal)
                atomic_write_bytes(files.key, key, mode=0o600)
                atomic_write_bytes(files.cert, cert)

            async def succeeded() -> types_pb2.Job | None:
                job = (await jobs.GetJob(scheduler_pb2.GetJobRequest(job_id=sub.job.id, team="team-a"))).job
                return job if job.state == types_pb2.JOB_STATE_SUCCEEDED else None
            job = await eventually(succeeded, timeout=30, what="the job to succeed")
            assert job.restarts == 0 and job.infra_restarts == 0 and job.attempt == 1
        # A connection made after the rotation, with the new tool certificate, is served.
        async with secure_channel(f"127.0.0.1:{app.grpc_port}", ClientTls(pki.files_for(live, OPS)),
                                  identity.SCHEDULER) as ch:
            listed = await scheduler_pb2_grpc.NodeServiceStub(ch).ListNodes(scheduler_pb2.ListNodesRequest())
            assert [n.state for n in listed.nodes] == [types_pb2.NODE_STATE_READY]
    finally:
        await agent.stop(kill_workers=True)
        await app.stop()
