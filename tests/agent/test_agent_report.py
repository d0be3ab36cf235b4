"""The reporter against a recording NodeService on a real port: registration, heartbeats, reconnects,
exit reports retried until acknowledged, and a refused registration."""

from __future__ import annotations

import sys
from pathlib import Path

import grpc.aio

from tests.agent.agent_kit import agent_settings, until
from tests.agent.conftest import Scheduler
from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard.common.v1 import types_pb2
from trainyard_agent.app import AgentApp
from trainyard_agent.report import Backoff
from trainyard_agent.workers import records

PY = sys.executable


def sleeper(job_id: str) -> agent_pb2.LaunchWorkersRequest:
    return agent_pb2.LaunchWorkersRequest(job_id=job_id, attempt=1, command=[PY, "-c", "import time; time.sleep(300)"],
                                          leader_epoch=1, workers=[agent_pb2.WorkerSpec(rank=0, gpu_indices=[2])])


async def test_registration_carries_the_whole_node(agent: AgentApp, scheduler: Scheduler) -> None:
    await until(lambda: scheduler.service.registers, "the agent to register")
    node = scheduler.service.registers[0].node
    assert node.node_id == "node-a" and node.agent_address == f"127.0.0.1:{agent.grpc_port}"
    assert node.worker_address == "127.0.0.1" and node.simulated and node.driver_version == "550.90.07"
    assert dict(node.labels) == {"rack": "r1", "switch": "s2"}
    assert node.cpus > 0 and node.memory_mb > 0 and node.hostname
    assert [g.index for g in node.gpus] == list(range(8))
    gpu = node.gpus[0]
    assert (gpu.vendor, gpu.model, gpu.memory_mb, gpu.compute_capability, gpu.health) == (
        "nvidia", "H100-80GB-HBM3", 81559, "9.0", types_pb2.GPU_HEALTH_HEALTHY)
    assert gpu.uuid.startswith("GPU-") and gpu.pci_bus_id and gpu.nvlink_island == -1


async def test_heartbeats_carry_sequence_and_metrics(agent: AgentApp, scheduler: Scheduler) -> None:
    await until(lambda: len(scheduler.service.heartbeats) >= 3, "three heartbeats")
    beats = scheduler.service.heartbeats[:3]
    assert [b.seq for b in beats] == sorted({b.seq for b in beats}) and all(b.node_id == "node-a" for b in beats)
    assert [m.index for m in beats[-1].gpu_metrics] == list(range(8))
    assert beats[-1].gpu_metrics[0].power_w == 72 and not beats[-1].gpus
    await until(lambda: agent.reporter is not None and agent.reporter.acked_seq >= beats[-1].seq,
                "the answers to be read")


async def test_reregister_keeps_workers_running(agent: AgentApp, scheduler: Scheduler, tmp_path: Path) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{agent.grpc_port}") as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        launched = await stub.LaunchWorkers(sleeper("job-long"))
        await until(lambda: any(b.running for b in scheduler.service.heartbeats), "a heartbeat with the job")
        scheduler.service.reregister_once = True
        await until(lambda: len(scheduler.service.registers) >= 2, "the agent to register again")
        running = scheduler.service.registers[-1].running
        assert [(r.job_id, r.attempt, list(r.ranks)) for r in running] == [("job-long", 1, [0])]
        listed = await stub.ListWorkers(agent_pb2.ListWorkersRequest())
        assert [(w.pid, w.running) for w in listed.workers] == [(launched.pids[0], True)]


async def test_a_restarted_scheduler_is_found_again(agent: AgentApp, scheduler: Scheduler) -> None:
    await until(lambda: scheduler.service.registers, "the agent to register")
    await scheduler.stop()
    await until(lambda: agent.reporter is not None and not agent.reporter.connected, "the agent to notice")
    await scheduler.restart()
    await until(lambda: len(scheduler.service.registers) >= 2, "the agent to register with the new scheduler")
    before = len(scheduler.service.heartbeats)
    await until(lambda: len(scheduler.service.heartbeats) > before, "heartbeats to flow again")


async def test_exit_reports_are_retried_until_acknowledged(agent: AgentApp, scheduler: Scheduler) -> None:
    scheduler.service.fail_exits = 3
    async with grpc.aio.insecure_channel(f"127.0.0.1:{agent.grpc_port}") as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        await stub.LaunchWorkers(agent_pb2.LaunchWorkersRequest(
            job_id="job-exit", attempt=1, command=[PY, "-c", "raise SystemExit(7)"], leader_epoch=1,
            workers=[agent_pb2.WorkerSpec(rank=0)]))
    await until(lambda: scheduler.service.exits, "the exit to be acknowledged")
    assert scheduler.service.exit_attempts == 4
    assert scheduler.service.exits[0].exit.exit_code == 7
    assert agent.supervisor is not None
    path = agent.supervisor.jobs_root / "job-exit" / "attempt-1" / records.RECORD_NAME
    await until(lambda: records.load(path).workers[0].reported, "the record to say reported")  # type: ignore[union-attr]


async def test_unreported_exits_of_a_previous_life_are_reported(tmp_path: Path, scheduler: Scheduler) -> None:
    settings = agent_settings(tmp_path / "state", scheduler.address)
    first = AgentApp(settings)
    await first.start()
    assert first.supervisor is not None
    async with grpc.aio.insecure_channel(f"127.0.0.1:{first.grpc_port}") as channel:
        await agent_pb2_grpc.AgentServiceStub(channel).LaunchWorkers(sleeper("job-prev"))
    await first.stop()  # workers keep running: an agent restart must not kill jobs
    assert first.supervisor.running_count() == 1

    second = AgentApp(settings)
    await second.start()  # finds the worker of the first life, stops it and reports it
    try:
        await until(lambda: [e.job_id for e in scheduler.service.exits] == ["job-prev"], "the exit report")
        assert scheduler.service.exits[0].exit.signal == 15
        assert second.supervisor is not None and second.supervisor.running_count() == 0
    finally:
        await second.stop(kill_workers=True)


async def test_a_refused_registration_is_fatal(tmp_path: Path, scheduler: Scheduler) -> None:
    scheduler.service.refuse = "node id node-a is reserved"
    app = AgentApp(agent_settings(tmp_path / "state", scheduler.address))
    await app.start()
    try:
        assert app.reporter is not None
        await until(lambda: app.reporter is not None and app.reporter.fatal_event.is_set(), "the refusal")
        assert app.reporter.fatal is not None
        assert "refused to register node 'node-a': node id node-a is reserved" in app.reporter.fatal.message
    finally:
        await app.stop()


def test_backoff_grows_is_capped_and_jittered() -> None:
    b = Backoff(0.1, 1.0)
    delays = [b.next() for _ in range(8)]
    assert 0.05 <= delays[0] <= 0.1 and all(0.5 <= d <= 1.0 for d in delays[5:])
    assert len({round(d, 6) for d in delays}) > 4
    b.reset()
    assert b.next() <= 0.1
