"""The scheduler's /metrics after real traffic: a real scheduler over mTLS with a real agent (4 simulated A100s),
jobs submitted, run, failed, preempted and left waiting, a refused call, a node lost; the endpoint served as the
process serves it (`telemetry.start_metrics_server` on the settings' metrics host and port) and parsed with
Prometheus' text parser. Label values stay within the configured queues and quota teams, gang-size buckets,
models and node states: no job or node id is a label value."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import grpc.aio
import pytest

from tests.scheduler.builders import make_job, make_node
from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import policy_pb2, policy_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from trainyard_agent.app import AgentApp
from trainyard_agent.settings import AgentSettings
from trainyard_core import telemetry
from trainyard_core.rpc.server import secure_channel
from trainyard_core.security import identity, pki
from trainyard_core.security.tls import ClientTls
from trainyard_core.testing.etcd import free_port
from trainyard_core.testing.metrics import Scrape, scrape
from trainyard_core.testing.wait import eventually
from trainyard_scheduler import metrics
from trainyard_scheduler.app import SchedulerApp
from trainyard_scheduler.domain.models import Allocation, JobState, NodeAssignment
from trainyard_scheduler.settings import SchedulerSettings

JOBS = "trainyard.scheduler.v1.JobService"


@dataclass
class Running:
    app: SchedulerApp
    agent: AgentApp
    settings: SchedulerSettings
    metrics_port: int
    tmp_path: Path


@pytest.fixture
async def running(etcd_settings: dict[str, str], key_prefix: str, pki_dir: Path,
                  tmp_path: Path) -> AsyncIterator[Running]:
    settings = SchedulerSettings.model_validate(dict(
        **etcd_settings, etcd_prefix=key_prefix.rstrip("/"), listen_port=0, leader_ttl_s=2,
        reconcile_interval_s=0.2, stop_grace_s=1.0, node_timeout_s=3.0, worker_fence_s=5.0, preempt_exempt_s=0,
        metrics_host="127.0.0.1", metrics_port=free_port(), **pki.files_for(pki_dir, identity.SCHEDULER).settings()))
    port = telemetry.start_metrics_server(settings.metrics_host, settings.metrics_port)
    assert port == settings.metrics_port
    app = SchedulerApp(settings)
    await app.start()

    async def leads() -> bool:
        return app.leadership.is_leader

    await eventually(leads, what="the scheduler to lead")
    agent = AgentApp(AgentSettings.model_validate(dict(
        node_id="node-1", gpu_profile="a100x4", scheduler_address=f"127.0.0.1:{app.grpc_port}",
        state_dir=str(tmp_path / "agent-node-1"), heartbeat_interval_s=0.2, stop_grace_s=1.0, single_tenant=True,
        **pki.files_for(pki_dir, identity.node("node-1")).settings())))
    await agent.start()
    try:
        yield Running(app, agent, settings, port, tmp_path)
    finally:
        await agent.stop(kill_workers=True)
        await app.stop()


def _spec(name: str, *, nodes: int = 1, gpus: int = 1, queue: str = "", command: list[str] | None = None,
          **more: object) -> types_pb2.JobSpec:
    return types_pb2.JobSpec(name=name, command=command or [sys.executable, "-c", "import time; time.sleep(60)"],
                             resources=types_pb2.Resources(nodes=nodes, gpus_per_node=gpus), queue=queue,
                             **more)  # type: ignore[arg-type]


def _delta(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
    return after.total(name, **labels) - before.total(name, **labels)


async def test_scheduler_metrics_follow_the_cluster(running: Running, pki_dir: Path) -> None:
    host, port = running.settings.metrics_host, running.metrics_port
    address = f"127.0.0.1:{running.app.grpc_port}"
    before = await scrape(host, port)
    gateway = ClientTls(pki.files_for(pki_dir, identity.GATEWAY))
    async with secure_channel(address, gateway, identity.SCHEDULER) as channel:
        jobs = scheduler_pb2_grpc.JobServiceStub(channel)
        nodes = scheduler_pb2_grpc.NodeServiceStub(channel)
        policy = policy_pb2_grpc.PolicyServiceStub(channel)

        async def registered() -> types_pb2.Node | None:
            listed = (await nodes.ListNodes(scheduler_pb2.ListNodesRequest())).nodes
            return listed[0] if listed else None

        node = await eventually(registered, what="node-1 registered")
        model = node.gpus[0].model
        await policy.PutQueue(policy_pb2.PutQueueRequest(queue=types_pb2.QueueConfig(name="batch")))
        await policy.PutQuota(policy_pb2.PutQuotaRequest(quota=types_pb2.TeamQuota(
            team="vision", limits={"*": types_pb2.QuotaLimit(nominal=4)})))

        async def submit(spec: types_pb2.JobSpec, team: str = "vision") -> str:
            reply = await jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec, team=team, user="ann"))
            return str(reply.job.id)

        async def state_of(job_id: str, team: str = "vision") -> int:
            return int((await jobs.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id, team=team))).job.state)

        # A job whose rank fails, with one restart left: one restart for a failure, then it fails.
        failing = await submit(_spec("fails", command=[sys.executable, "-c", "raise SystemExit(3)"], max_restarts=1,
                                     restart_backoff_s=0.0))

        async def failed() -> bool:
            return await state_of(failing) == types_pb2.JOB_STATE_FAILED

        await eventually(failed, timeout=30, what="the failing job to fail after its restart")

        # One gang running (2 of the 4 GPUs), two waiting for more GPUs than are free (the holder's standing is
        # theirs, so they do not preempt it): one in queue batch of team vision, one of a team without a quota
        # (counted as _other).
        holder = await submit(_spec("holder", gpus=2))

        async def holder_runs() -> bool:
            return await state_of(holder) == types_pb2.JOB_STATE_RUNNING

        await eventually(holder_runs, timeout=30, what="the holder to run")
        batch = await submit(_spec("wide", gpus=4, queue="batch"))
        nlp = await submit(_spec("wider", gpus=3), team="nlp")

        async def gauges() -> Scrape | None:
            now = await scrape(host, port)
            return now if (now.value("trainyard_scheduler_queue_depth", queue="batch", gang="2-8") == 1
                           and now.value("trainyard_scheduler_queue_depth", queue="default", gang="2-8") == 1
                           and now.value("trainyard_scheduler_model_gpus_allocated", model=model) == 2) else None

        now = await eventually(gauges, timeout=15, what="queue depth and allocation to show the jobs")
        assert now.value("trainyard_scheduler_queue_depth", queue="default", gang="1") == 0  # every configured pair
        assert now.value("trainyard_scheduler_queue_depth", queue="default", gang="9-64") == 0
        assert now.label_values("trainyard_scheduler_queue_depth", "queue") == {"default", "batch"}
        assert now.label_values("trainyard_scheduler_queue_depth", "gang") == set(metrics.GANG_SIZES)
        assert (now.value("trainyard_scheduler_queue_oldest_wait_seconds", queue="batch", gang="2-8") or -1) >= 0
        assert now.value("trainyard_scheduler_queue_oldest_wait_seconds", queue="batch", gang="1") == 0
        assert now.value("trainyard_scheduler_team_jobs_waiting", team="vision") == 1
        assert now.value("trainyard_scheduler_team_jobs_waiting", team="_other") == 1  # nlp has no quota
        assert now.value("trainyard_scheduler_team_gpus_allocated", team="vision") == 2
        assert now.value("trainyard_scheduler_model_gpus_healthy", model=model) == 4
        assert now.value("trainyard_scheduler_model_allocation_ratio", model=model) == 0.5
        assert now.value("trainyard_scheduler_gpus_allocated") == 2
        assert now.value("trainyard_scheduler_gpus_healthy") == 4
        for state, count in (("ready", 1), ("not_ready", 0), ("cordoned", 0)):
            assert now.value("trainyard_scheduler_nodes_by_state", state=state) == count
        assert now.value("trainyard_scheduler_jobs", state="pending") == 2
        assert now.types["trainyard_scheduler_queue_wait_seconds"] == "histogram"
        # Placed: the failing job twice (1 GPU), the holder once (2 GPUs), each observed with its queue's wait.
        assert _delta(before, now, "trainyard_scheduler_queue_wait_seconds_count", queue="default", gang="1") == 2
        assert _delta(before, now, "trainyard_scheduler_queue_wait_seconds_count", queue="default", gang="2-8") == 1
        # A decision whose write lost a race is taken and counted again: at least the three placements.
        assert _delta(before, now, "trainyard_scheduler_decisions_total", kind="place") >= 3
        assert _delta(before, now, "trainyard_scheduler_restarts_total", reason="failure", team="vision") == 1
        assert now.total("trainyard_scheduler_reconcile_seconds_count") > before.total(
            "trainyard_scheduler_reconcile_seconds_count")

        # Refusals count under the code the caller got: a node may not submit jobs; an unknown job is not found.
        node_2 = ClientTls(pki.files_for(pki_dir, identity.node("node-2")))
        async with secure_channel(address, node_2, identity.SCHEDULER) as as_node:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await scheduler_pb2_grpc.JobServiceStub(as_node).SubmitJob(
                    scheduler_pb2.SubmitJobRequest(spec=_spec("nope"), team="vision", user="ann"))
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await jobs.GetJob(scheduler_pb2.GetJobRequest(job_id="j-does-not-exist", team="vision"))
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND

        # A job of a higher class needs the whole node: the holder is preempted for it.
        urgent = await submit(_spec("urgent", gpus=4, priority_class="high"))

        async def urgent_runs() -> bool:
            return await state_of(urgent) == types_pb2.JOB_STATE_RUNNING

        await eventually(urgent_runs, timeout=30, what="the urgent job to run after preempting the holder")
        after_preemption = await scrape(host, port)

        # The node is lost: its state, the loss, and the urgent job restarted for it. The agent goes away as a
        # dead host's does, leaving its workers to their fence: an agent that stops its workers itself reports
        # their exits, and a job whose worker was killed while its node was still alive has failed, not lost its
        # node (whatever the scheduler placed on the dying node in the meantime would have been counted instead).
        await running.agent.stop(kill_workers=False)

        async def lost() -> Scrape | None:
            now = await scrape(host, port)
            return now if (now.value("trainyard_scheduler_nodes_by_state", state="not_ready") == 1
                           and _delta(before, now, "trainyard_scheduler_restarts_total", reason="node_lost",
                                      team="vision") == 1
                           and await state_of(urgent) in (types_pb2.JOB_STATE_RESTARTING,
                                                          types_pb2.JOB_STATE_PENDING)) else None

        end = await eventually(lost, timeout=20, what="the node to be lost and the urgent job restarted")

    assert _delta(before, after_preemption, "trainyard_scheduler_preemptions_total", reason="priority",
                  team="vision") == 1
    assert _delta(before, after_preemption, "trainyard_scheduler_decisions_total", kind="preempt") >= 1
    assert end.value("trainyard_scheduler_nodes_by_state", state="ready") == 0
    assert _delta(before, end, "trainyard_scheduler_nodes_lost_total") == 1
    assert end.value("trainyard_scheduler_model_allocation_ratio", model=model) == 0  # no healthy GPU is live
    assert _delta(before, end, "grpc_server_handled_total", grpc_type="unary", grpc_service=JOBS,
                  grpc_method="SubmitJob", grpc_code="PermissionDenied") == 1
    assert _delta(before, end, "grpc_server_handled_total", grpc_service=JOBS, grpc_method="GetJob",
                  grpc_code="NotFound") == 1
    assert _delta(before, end, "grpc_server_handled_total", grpc_service=JOBS, grpc_method="SubmitJob",
                  grpc_code="OK") == 5
    # Bounded labels: no job, node or request id is a label value of the scheduler's series.
    ids = {failing, holder, batch, nlp, urgent, "node-1", "node-2", "j-does-not-exist"}
    values = {v for s in end.samples if s.name.startswith("trainyard_scheduler_") for v in s.labels.values()}
    assert not values & ids

    # A replica that no longer leads reports no queue, and no backlog of its own (its last value would stand
    # beside the new leader's).
    metrics.HISTORY_BACKLOG.set(7)
    metrics.AUDIT_BACKLOG.set(9)
    await running.app.stop()
    stopped = await scrape(host, port)
    assert stopped.matching("trainyard_scheduler_queue_depth") == []
    assert stopped.matching("trainyard_scheduler_nodes_by_state") == []
    assert stopped.value("trainyard_scheduler_history_backlog_jobs") == 0
    assert stopped.value("trainyard_scheduler_audit_backlog_entries") == 0


# --- the vocabularies, as tables -------------------------------------------------------------------------------

@pytest.mark.parametrize(("gpus", "bucket"), [(0, "cpu"), (1, "1"), (2, "2-8"), (8, "2-8"), (9, "9-64"), (64, "9-64"),
                                              (65, "65-512"), (512, "65-512"), (513, "513+"), (4096, "513+")])
def test_gang_sizes_fall_in_bounded_buckets(gpus: int, bucket: str) -> None:
    assert metrics.gang_size(gpus) == bucket
    assert bucket in metrics.GANG_SIZES


def test_bounds_keep_only_configured_queues_and_quota_teams() -> None:
    bounds = metrics.Bounds()
    bounds.update({"default": object(), "batch": object()}, {"vision": object()})
    assert [bounds.queue(q) for q in ("default", "batch", "gone")] == ["default", "batch", metrics.OTHER]
    assert [bounds.team(t) for t in ("vision", "nlp")] == ["vision", metrics.OTHER]


def _alloc(**more: object) -> Allocation:
    return Allocation(job_id="j-1", attempt=1, master_addr="10.0.0.1", master_port=29500, created_at=0.0,
                      assignments=(NodeAssignment("node-a", 0, (0, 1), (0, 1), model="A100"),), **more)  # type: ignore[arg-type]


@pytest.mark.parametrize(("after_state", "counted", "alloc", "alive", "sick", "reason"), [
    (JobState.RESTARTING, "restarts", {}, True, False, "failure"),
    (JobState.RESTARTING, "infra", {}, False, False, "node_lost"),
    (JobState.RESTARTING, "infra", {}, True, True, "gpu_unhealthy"),
    (JobState.RESTARTING, "infra", {}, True, False, "infrastructure"),
    (JobState.PENDING, "", {"requeued_by": "user:vision/ann"}, True, False, "requeue"),
    (JobState.PENDING, "", {"preempted_by": "j-2"}, True, False, None),  # a preemption, counted as one
    (JobState.FAILED, "", {}, True, False, None),
    (JobState.SUCCEEDED, "", {}, True, False, None),
])
def test_restart_reasons(after_state: JobState, counted: str, alloc: dict[str, object], alive: bool, sick: bool,
                         reason: str | None) -> None:
    before = make_job("j-1", state=JobState.RUNNING)
    after = replace(make_job("j-1", state=after_state), restarts=1 if counted == "restarts" else 0,
                    infra_restarts=1 if counted == "infra" else 0)
    node = make_node("node-a", gpus=4, model="A100", unhealthy=(1,) if sick else ())
    found = metrics.restart_reason(before, after, _alloc(**alloc), frozenset({"node-a"} if alive else ()),
                                   {"node-a": node})
    assert found == reason
    assert found is None or found in metrics.RESTART_REASONS
