"""Helpers of the node agent's tests: builders for launch requests and supervisors, a recording exit sink,
a process-tree script, and `Scheduler`, the real scheduler the agent talks to. Worker processes are real
(`sys.executable`)."""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import grpc
import grpc.aio
from google.protobuf.timestamp_pb2 import Timestamp

from bench._swarm import accelerators, node_info
from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_agent.health.book import HealthBook
from trainyard_agent.model import Health, Vendor
from trainyard_agent.notify import Notifier
from trainyard_agent.report import Backoff, Link, NodeView, Reporter
from trainyard_agent.settings import AgentSettings
from trainyard_agent.workers.fence import LeaderFence
from trainyard_agent.workers.model import LaunchRequest, WorkerExit, WorkerSpec
from trainyard_agent.workers.supervisor import Supervisor
from trainyard_core.rpc.server import GrpcServer, insecure_channel, start_grpc_server
from trainyard_core.testing.wait import eventually
from trainyard_scheduler.app import SchedulerApp
from trainyard_scheduler.domain.models import WorkerExit as RecordedExit
from trainyard_scheduler.settings import SchedulerSettings
from trainyard_scheduler.state.repository import Repository

PY = sys.executable

# A process tree for group tests: each level appends its pid to a file, starts the next level, then
# sleeps (or exits at once with mode "exit" at the top). With "ignore" SIGTERM is ignored by every level
# (SIG_IGN survives exec).
TREE = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    depth, out, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    if mode == "ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if depth > 0:
        subprocess.Popen([sys.executable, __file__, str(depth - 1), out, "sleep" if mode == "exit" else mode])
    with open(out, "a") as f:
        f.write(f"{os.getpid()}\\n")
    if mode == "exit":
        # Leave only once the whole tree has started, so its descendants are there to be cleaned up.
        while len(open(out).read().split()) < depth + 1:
            time.sleep(0.01)
        sys.exit(0)
    time.sleep(300)
""")


class RecordingSink:
    def __init__(self) -> None:
        self.exits: list[WorkerExit] = []
        self.changed = Notifier()

    def submit(self, exit: WorkerExit) -> None:
        self.exits.append(exit)
        self.changed.notify()

    def by_rank(self, job_id: str) -> dict[int, WorkerExit]:
        return {e.rank: e for e in self.exits if e.job_id == job_id}


async def until(predicate: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    async def probe() -> object:
        return predicate()

    await eventually(probe, timeout=timeout, what=what)


def launch(job_id: str, command: list[str], *, ranks: int = 1, gpus_per_rank: int = 0, attempt: int = 1,
           env: dict[str, str] | None = None, working_dir: str = "", epoch: int = 0) -> LaunchRequest:
    workers = tuple(WorkerSpec(rank=r, local_rank=r,
                               gpu_indices=tuple(range(r * gpus_per_rank, (r + 1) * gpus_per_rank)))
                    for r in range(ranks))
    return LaunchRequest(job_id=job_id, attempt=attempt, command=tuple(command), env=env or {},
                         working_dir=working_dir, workers=workers, leader_epoch=epoch)


def make_supervisor(state_dir: Path, sink: RecordingSink, *, gpus: int = 4, grace: float = 5.0,
                    health: list[tuple[Health, str]] | None = None, vendor: Vendor = Vendor.NVIDIA,
                    log_max_bytes: int = 1 << 20, log_backups: int = 2) -> Supervisor:
    states = health if health is not None else [(Health.HEALTHY, "")] * gpus
    return Supervisor(state_dir=state_dir, node_id="node-a", vendor=vendor, gpu_health=lambda: states,
                      base_env=dict(os.environ), site_env={"SITE_DEFAULT": "1", "OVERRIDDEN": "site"},
                      stop_grace_s=grace, log_max_bytes=log_max_bytes, log_backups=log_backups, exits=sink)


def read_pids(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def agent_settings(state_dir: Path, scheduler_address: str, **overrides: object) -> AgentSettings:
    values: dict[str, object] = dict(
        node_id="node-a", scheduler_address=scheduler_address, gpu_profile="h100x8", state_dir=str(state_dir),
        heartbeat_interval_s=0.2, stop_grace_s=2.0, labels={"rack": "r1", "switch": "s2"},
        worker_env={"GLOO_SOCKET_IFNAME": "lo"}, reconnect_initial_s=0.05, reconnect_max_s=0.3,
        # Tenancy has its own tests (test_tenancy.py); everything else runs as the test's own user.
        single_tenant=True)
    values.update(overrides)
    return AgentSettings.model_validate(values)


class Scheduler:
    """The real scheduler (`SchedulerApp`) on the session's etcd, under the test's own key prefix, serving on a
    real port. `stop()` then `start()` (or `restart()`) brings a new one up on the same port and prefix, as a
    restarted scheduler process would. What it records is read through its own APIs (NodeService, JobService)
    and through its repository in etcd."""

    def __init__(self, etcd: Mapping[str, str], key_prefix: str, **options: object) -> None:
        values: dict[str, object] = dict(
            **etcd, etcd_prefix=key_prefix.rstrip("/"), listen_port=0, leader_ttl_s=2,
            reconcile_interval_s=0.2, node_timeout_s=3.0, stop_grace_s=1.0, heartbeat_interval_ms=200)
        values.update(options)
        self._values = values
        self.app: SchedulerApp | None = None
        self.port = 0
        self._channel: grpc.aio.Channel | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def running(self) -> SchedulerApp:
        assert self.app is not None, "the scheduler is stopped"
        return self.app

    @property
    def epoch(self) -> int:
        """The leader epoch of the running scheduler (its etcd election key's create revision)."""
        return self.running.leadership.epoch

    @property
    def repo(self) -> Repository:
        return Repository(self.running.store, self.running.keys)

    @property
    def nodes(self) -> scheduler_pb2_grpc.NodeServiceStub:
        assert self._channel is not None, "the scheduler is stopped"
        return scheduler_pb2_grpc.NodeServiceStub(self._channel)

    @property
    def jobs(self) -> scheduler_pb2_grpc.JobServiceStub:
        assert self._channel is not None, "the scheduler is stopped"
        return scheduler_pb2_grpc.JobServiceStub(self._channel)

    async def start(self, timeout: float = 10.0) -> None:
        """Start on `self.port` (0 the first time: a free port) and wait until this replica leads."""
        settings = SchedulerSettings.model_validate({**self._values, "listen_port": self.port})
        deadline = time.monotonic() + timeout
        while True:
            app = SchedulerApp(settings)
            try:
                await app.start()
                break
            except OSError:
                await app.stop()
                if not self.port or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)  # the previous server's port may linger for a moment
        self.app, self.port = app, app.grpc_port
        self._channel = grpc.aio.insecure_channel(self.address)

        async def leads() -> bool:
            return app.leadership.is_leader

        await eventually(leads, timeout=timeout, what="the scheduler to lead")

    async def stop(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
        if self.app is not None:
            await self.app.stop()
            self.app = None

    async def restart(self) -> None:
        await self.stop()
        await self.start()

    async def node(self, node_id: str = "node-a") -> types_pb2.Node | None:
        """NodeService.GetNode, None while the node is not registered."""
        try:
            got: scheduler_pb2.GetNodeResponse = await self.nodes.GetNode(
                scheduler_pb2.GetNodeRequest(node_id=node_id))
            return got.node
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise

    async def registered(self, node_id: str = "node-a", *, after: float = 0.0,
                         timeout: float = 10.0) -> types_pb2.Node:
        """Wait until `node_id` is registered (with a registration time later than `after`, in seconds)."""
        async def probe() -> types_pb2.Node | None:
            node = await self.node(node_id)
            return node if node is not None and seconds(node.registered_at) > after else None

        return await eventually(probe, timeout=timeout, what=f"node {node_id} to register")

    async def submit(self, command: list[str], *, gpus: int = 1) -> str:
        """JobService.SubmitJob of a one-node job; returns its id. The scheduler places it and launches its
        workers through the agent."""
        spec = types_pb2.JobSpec(name="agent-test", command=command,
                                 resources=types_pb2.Resources(nodes=1, gpus_per_node=gpus))
        sub: scheduler_pb2.SubmitJobResponse = await self.jobs.SubmitJob(
            scheduler_pb2.SubmitJobRequest(spec=spec, team="agent-tests", user="t"))
        return sub.job.id

    async def job(self, job_id: str) -> types_pb2.Job:
        got: scheduler_pb2.GetJobResponse = await self.jobs.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id))
        return got.job

    async def job_in(self, job_id: str, state: types_pb2.JobState.ValueType,
                     timeout: float = 10.0) -> types_pb2.Job:
        async def probe() -> types_pb2.Job | None:
            job = await self.job(job_id)
            return job if job.state == state else None

        return await eventually(probe, timeout=timeout,
                                what=f"job {job_id} to be {types_pb2.JobState.Name(state)}")

    async def recorded_exits(self, job_id: str) -> list[RecordedExit]:
        """The worker exits the scheduler has recorded for the job, read without a race: from the live
        allocation, or once that is released, from the terminal job (written in the same transaction)."""
        found = await self.repo.get_allocation(job_id)
        if found is not None:
            return sorted(found[0].exits, key=lambda e: e.rank)
        job = await self.repo.get_job(job_id)
        return list(job[0].exits) if job is not None else []


async def scripted_reporter(servicer: scheduler_pb2_grpc.NodeServiceServicer) -> tuple[Reporter, GrpcServer]:
    """A started `Reporter` for node-1 (backoff 50-100 ms, refresh every 30 s) towards a NodeService that
    `servicer` scripts, served on a free loopback port; the caller stops both."""
    server = await start_grpc_server(
        host="127.0.0.1", port=0, service_names=["trainyard.scheduler.v1.NodeService"],
        register=lambda s: scheduler_pb2_grpc.add_NodeServiceServicer_to_server(servicer, s))
    target = f"127.0.0.1:{server.port}"
    view = NodeView(node_info=lambda: node_info("node-1", "127.0.0.1:1", {}), running=list,
                    health=HealthBook(accelerators("node-1")))
    reporter = Reporter(node_id="node-1", connect=lambda: Link(insecure_channel(target), target), view=view,
                        fence=LeaderFence(), interval_s=30.0, backoff=Backoff(0.1, 0.1))
    reporter.start()
    return reporter, server


def seconds(ts: Timestamp) -> float:
    """A protobuf Timestamp as float seconds (0.0 when unset)."""
    return ts.ToNanoseconds() / 1e9
