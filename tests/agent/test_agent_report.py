"""The reporter against the real scheduler (real etcd, real port): registration, heartbeats, reconnects to a
restarted scheduler, exit reports retried until acknowledged, and a refused registration."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from bench._swarm import accelerators
from tests.agent.agent_kit import Scheduler, agent_settings, scripted_reporter, seconds, until
from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_agent.app import AgentApp
from trainyard_agent.grpc import convert
from trainyard_agent.health.book import HealthBook
from trainyard_agent.model import RunningAllocation
from trainyard_agent.notify import Notifier
from trainyard_agent.report import Backoff, NodeView, Reporter
from trainyard_agent.workers import records
from trainyard_agent.workers.fence import LeaderFence
from trainyard_core.errors import Busy
from trainyard_core.testing.wait import eventually, truthy

PY = sys.executable
SLEEP = [PY, "-c", "import time; time.sleep(300)"]


async def test_registration_carries_the_whole_node(agent: AgentApp, scheduler: Scheduler) -> None:
    node = await scheduler.registered()
    assert node.node_id == "node-a" and node.agent_address == f"127.0.0.1:{agent.grpc_port}"
    assert node.worker_address == "127.0.0.1" and node.simulated and node.driver_version == "550.90.07"
    assert dict(node.labels) == {"rack": "r1", "switch": "s2"}
    assert node.cpus > 0 and node.memory_mb > 0 and node.hostname
    assert node.state == types_pb2.NODE_STATE_READY
    assert [g.index for g in node.gpus] == list(range(8))
    gpu = node.gpus[0]
    assert (gpu.vendor, gpu.model, gpu.memory_mb, gpu.health, gpu.health_action) == (
        "nvidia", "H100-80GB-HBM3", 81559, types_pb2.GPU_HEALTH_HEALTHY, "none")
    assert gpu.uuid.startswith("GPU-") and gpu.compute_capability == "9.0" and gpu.pci_bus_id == "00000000:18:00.0"
    # Topology: one NVLink island of 8 (NVSwitch, NV18), two NUMA nodes, PCIe levels per pair.
    assert node.cuda_version == "12.4"
    assert [g.nvlink_island for g in node.gpus] == [0] * 8
    assert [g.numa_node for g in node.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    links = {(x.gpu_a, x.gpu_b): (x.level, x.nvlinks) for x in node.gpu_links}
    assert len(links) == 28 and links[(0, 1)] == ("NODE", 18) and links[(3, 4)] == ("SYS", 18)
    # The scheduler keeps no record of these GPU fields (its node model has none): check what the agent
    # puts into RegisterNode for them.
    sent = convert.node_to_pb(agent.node_info()).gpus
    assert not any(g.mig_enabled for g in sent)
    assert agent.inventory is not None
    for g, known in zip(sent, agent.inventory.accelerators, strict=True):
        assert list(g.cpu_affinity) == list(known.cpu_affinity) and g.cpu_affinity


async def test_rack_and_switch_labels_come_from_the_topology_file(tmp_path: Path, scheduler: Scheduler) -> None:
    topology = tmp_path / "topology.yaml"
    topology.write_text("labels: {site: dc1}\nnodes:\n  node-a: {rack: r12, switch: leaf-3}\n"
                        "  node-b: {rack: r13, switch: leaf-4}\n")
    settings = agent_settings(tmp_path / "state", scheduler.address, topology_file=str(topology),
                              labels={"switch": "leaf-9"})  # the agent's own setting wins over the file
    app = AgentApp(settings)
    await app.start()
    try:
        node = await scheduler.registered()
        assert dict(node.labels) == {"site": "dc1", "rack": "r12", "switch": "leaf-9"}
    finally:
        await app.stop()


@pytest.mark.parametrize("profile,islands,cuda", [("l40sx4", [-1] * 4, "12.4"), ("mi300x8", [0] * 8, ""),
                                                  ("cpu", [], "")])
async def test_other_profiles_register_their_topology(tmp_path: Path, scheduler: Scheduler, profile: str,
                                                      islands: list[int], cuda: str) -> None:
    app = AgentApp(agent_settings(tmp_path / "state", scheduler.address, gpu_profile=profile))
    await app.start()
    try:
        node = await scheduler.registered()
        assert [g.nvlink_island for g in node.gpus] == islands and node.cuda_version == cuda
        n = len(islands)
        assert len(node.gpu_links) == n * (n - 1) // 2
        assert all((x.nvlinks > 0) == (islands[0] >= 0) for x in node.gpu_links)
        assert {g.vendor for g in node.gpus} <= {"amd" if profile == "mi300x8" else "nvidia"}
    finally:
        await app.stop()


async def test_heartbeats_reach_the_scheduler_and_are_answered(agent: AgentApp, scheduler: Scheduler) -> None:
    registered = await scheduler.registered()
    node_key = scheduler.running.keys.node("node-a")
    kv = await scheduler.running.store.get(node_key)
    assert kv is not None

    async def heartbeat_after(t: float) -> types_pb2.Node | None:
        node = await scheduler.node()
        return node if node is not None and seconds(node.last_heartbeat) > t else None

    # The scheduler answers each beat with its sequence number, and notes when it heard from the node.
    await until(lambda: agent.reporter is not None and agent.reporter.acked_seq >= 3, "three answered heartbeats")
    assert agent.reporter is not None and agent.reporter.acked_seq <= agent.reporter.seq
    first = await eventually(lambda: heartbeat_after(seconds(registered.last_heartbeat)), what="a heartbeat")
    later = await eventually(lambda: heartbeat_after(seconds(first.last_heartbeat)), what="another heartbeat")
    assert later.registered_at == registered.registered_at and later.state == types_pb2.NODE_STATE_READY
    # Beats without health changes carry no GPUs, so the node record is never rewritten by them.
    after = await scheduler.running.store.get(node_key)
    assert after is not None and after.mod_revision == kv.mod_revision
    # GPU metrics do not travel in beats (the scheduler never used them): they are on the agent's Prometheus
    # endpoint, read from NVML by the monitor.
    assert agent.monitor is not None
    assert [m.index for m in agent.monitor.latest] == list(range(8)) and agent.monitor.latest[0].power_w == 72
    assert agent.fake is not None
    agent.fake.add_link_errors(2, nvlink=3, pcie_replays=4)
    agent.fake.add_ecc_errors(2, 1)  # its event triggers a counter read at once
    await until(lambda: agent.monitor is not None and agent.monitor.latest[2].counters.pcie_replays == 4,
                "the counters to be read")
    beat = convert.heartbeat_request(node_id="node-a", seq=1, sent_at=0.0, changed_gpus=[], running=[])
    assert not beat.gpu_metrics
    exported = {s.name: s.value for m in REGISTRY.collect() for s in m.samples
                if s.name in ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
                              "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "DCGM_FI_DEV_SM_CLOCK")
                and (s.labels["node"], s.labels["gpu"]) == ("node-a", "2")}
    assert exported == {"DCGM_FI_DEV_PCIE_REPLAY_COUNTER": 4.0, "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL": 3.0,
                        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": 1.0, "DCGM_FI_DEV_SM_CLOCK": 1980.0}


async def test_reregister_keeps_workers_running(agent: AgentApp, scheduler: Scheduler,
                                                agent_stub: agent_pb2_grpc.AgentServiceStub) -> None:
    before = await scheduler.registered()
    job_id = await scheduler.submit(SLEEP)
    job = await scheduler.job_in(job_id, types_pb2.JOB_STATE_RUNNING)
    listed = await agent_stub.ListWorkers(agent_pb2.ListWorkersRequest())
    assert [(w.job_id, w.running) for w in listed.workers] == [(job_id, True)]

    await scheduler.restart()
    await scheduler.registered(after=seconds(before.registered_at))
    # The new registration carries the allocations still running here (the scheduler rebuilds from etcd
    # and does not record them, so check the agent's side of it).
    assert agent.supervisor is not None
    assert [(r.job_id, r.attempt, list(r.ranks)) for r in convert.running_to_pb(
        agent.supervisor.running_allocations())] == [(job_id, job.attempt, [0])]
    again = await agent_stub.ListWorkers(agent_pb2.ListWorkersRequest())
    assert [(w.pid, w.running) for w in again.workers] == [(listed.workers[0].pid, True)]
    assert (await scheduler.job(job_id)).state == types_pb2.JOB_STATE_RUNNING


async def test_a_restarted_scheduler_is_found_again(agent: AgentApp, scheduler: Scheduler) -> None:
    before = await scheduler.registered()
    await scheduler.stop()
    await until(lambda: agent.reporter is not None and not agent.reporter.connected, "the agent to notice")
    await scheduler.start()
    node = await scheduler.registered(after=seconds(before.registered_at))
    assert node.agent_address == f"127.0.0.1:{agent.grpc_port}"

    async def heartbeat() -> types_pb2.Node | None:
        now = await scheduler.node()
        return now if now is not None and seconds(now.last_heartbeat) > seconds(node.last_heartbeat) else None

    beat = await eventually(heartbeat, what="heartbeats to flow again")
    assert beat.registered_at == node.registered_at


async def test_exit_reports_are_retried_until_acknowledged(agent: AgentApp, scheduler: Scheduler,
                                                           tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    go = tmp_path / "go"
    code = "import os, sys, time\nwhile not os.path.exists(sys.argv[1]):\n    time.sleep(0.02)\nsys.exit(7)\n"
    await scheduler.registered()
    job_id = await scheduler.submit([PY, "-c", code, str(go)])
    job = await scheduler.job_in(job_id, types_pb2.JOB_STATE_RUNNING)
    assert agent.supervisor is not None and agent.exit_reporter is not None
    path = agent.supervisor.jobs_root / job_id / f"attempt-{job.attempt}" / records.RECORD_NAME

    await scheduler.stop()
    caplog.set_level(logging.WARNING, logger="trainyard_agent.report")
    go.touch()  # the worker exits while the scheduler is down
    await until(lambda: any("cannot report a worker exit yet; retrying" in m for m in caplog.messages),
                "a failed exit report")
    assert [(e.job_id, e.exit_code) for e in agent.exit_reporter.pending] == [(job_id, 7)]
    assert not records.load(path).workers[0].reported  # type: ignore[union-attr]

    await scheduler.start()  # on the same port: the retries find it
    done = await scheduler.job_in(job_id, types_pb2.JOB_STATE_FAILED)
    assert [(e.rank, e.node_id, e.exit_code, e.signal) for e in done.exits] == [(0, "node-a", 7, 0)]
    assert done.exit_code == 7 and done.exits[0].exited_at.seconds > 0
    await until(lambda: records.load(path).workers[0].reported, "the record to say reported")  # type: ignore[union-attr]
    assert not agent.exit_reporter.pending


async def test_unreported_exits_of_a_previous_life_are_reported(tmp_path: Path, scheduler: Scheduler) -> None:
    settings = agent_settings(tmp_path / "state", scheduler.address, worker_restart_policy="stop")
    first = AgentApp(settings)
    await first.start()
    assert first.supervisor is not None
    try:
        await scheduler.registered()
        job_id = await scheduler.submit(SLEEP)
        await scheduler.job_in(job_id, types_pb2.JOB_STATE_RUNNING)
    finally:
        await first.stop()  # workers keep running: an agent restart must not kill jobs
    assert first.supervisor.running_count() == 1

    second = AgentApp(settings)
    await second.start()  # finds the worker of the first life, stops it and reports it
    try:
        done = await scheduler.job_in(job_id, types_pb2.JOB_STATE_FAILED)
        assert [(e.rank, e.node_id, e.exit_code, e.signal) for e in done.exits] == [(0, "node-a", 143, 15)]
        assert second.supervisor is not None and second.supervisor.running_count() == 0
    finally:
        await second.stop(kill_workers=True)


async def test_a_refused_registration_is_fatal(tmp_path: Path, scheduler: Scheduler) -> None:
    # The agent checks node ids by the scheduler's own rule, so no valid agent setting is refused; an
    # agent whose check differs (here: none) stands in for version skew, and the scheduler's refusal is real.
    settings = agent_settings(tmp_path / "state", scheduler.address).model_copy(update={"node_id": "Node-A"})
    app = AgentApp(settings)
    await app.start()
    try:
        assert app.reporter is not None
        await until(lambda: app.reporter is not None and app.reporter.fatal_event.is_set(), "the refusal")
        assert app.reporter.fatal is not None
        assert ("refused to register node 'Node-A': node_id 'Node-A' must be 3-63 lower-case letters"
                in app.reporter.fatal.message)
        assert await scheduler.node("Node-A") is None
    finally:
        await app.stop()


def test_backoff_grows_is_capped_and_jittered() -> None:
    b = Backoff(0.1, 1.0)
    delays = [b.next() for _ in range(8)]
    assert 0.05 <= delays[0] <= 0.1 and all(0.5 <= d <= 1.0 for d in delays[5:])
    assert len({round(d, 6) for d in delays}) > 4
    b.reset()
    assert b.next() <= 0.1


async def test_a_change_while_a_beat_is_in_flight_is_reported_at_once_not_at_the_refresh() -> None:
    """The beat generator is suspended at its yield until gRPC takes the message; a gang that stops meanwhile
    notifies with nobody waiting. The next beat must still come at once (it came only at the next refresh,
    30 s by default, and the scheduler held the node's GPUs for strays that long)."""
    running = [RunningAllocation("job-1", 1, (0, 1))]
    changes = Notifier()
    view = NodeView(node_info=lambda: pytest.fail("the beats do not read the node's inventory"),
                    running=lambda: list(running),
                    health=HealthBook(accelerators("node-1")), changes=changes)
    reporter = Reporter(node_id="node-1", connect=lambda: None, view=view, fence=LeaderFence(),  # type: ignore[arg-type,return-value]
                        interval_s=30.0, backoff=Backoff(0.1, 1.0))
    beats = reporter._beats(registered_version=0, interval=30.0)
    first = await beats.__anext__()
    assert [r.job_id for r in first.running] == ["job-1"]
    running.clear()        # the gang stops while the first beat is still the generator's last word
    changes.notify()
    second = await asyncio.wait_for(beats.__anext__(), timeout=2.0)
    assert list(second.running) == [] and second.seq == first.seq + 1
    await beats.aclose()  # type: ignore[attr-defined]


class BusyScheduler(scheduler_pb2_grpc.NodeServiceServicer):
    """A leader busy with a failover's registrations: it refuses each one with an appointment (as
    trainyard_core.rpc.admission does), noting when each came."""

    def __init__(self, retry_after_s: float) -> None:
        self.retry_after_s = retry_after_s
        self.came: list[float] = []

    async def RegisterNode(self, request: scheduler_pb2.RegisterNodeRequest, context: object) -> None:
        self.came.append(time.monotonic())
        raise Busy("this server is busy with 4000 calls of RegisterNode", retry_after_s=self.retry_after_s)


async def test_a_busy_leaders_appointment_is_kept_instead_of_the_backoff() -> None:
    """A leader that refuses a registration with an appointment (a failover's storm) is not asked again before
    it: the agent's own backoff (here 50-100 ms) would bring the whole fleet back long before it can be served."""
    busy = BusyScheduler(retry_after_s=1.0)
    reporter, server = await scripted_reporter(busy)
    try:
        await eventually(lambda: truthy(len(busy.came) >= 3), timeout=10)
    finally:
        await reporter.stop()
        await server.server.stop(grace=0)
    gaps = [b - a for a, b in zip(busy.came, busy.came[1:], strict=False)]
    assert all(gap >= 1.0 for gap in gaps), gaps
    assert reporter.registrations == 0
