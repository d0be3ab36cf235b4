"""The inside of a swarm process (`_swarm.Swarm` starts it): many simulated node agents on one event loop.

Each `SimAgent` is what a node agent is to the scheduler, without a host under it:

- the real `Reporter` (RegisterNode, the Heartbeat stream, the worker fence) and `ExitReporter`, each with its
  own channel from the agent's own `scheduler_channel`, presenting the node's certificate;
- the agents' real gRPC bootstrap (`start_grpc_server`: mTLS, the authorization table, the error mapping)
  serving AgentService from the node's certificate, on a port of its own: a launch does not name its node,
  and gRPC's Python server tells a servicer neither the address nor the name (`:authority`) a call was
  made to, so one server cannot serve several nodes. It costs about 80 KB and 1.5 ms to start, and nothing
  while idle;
- `SimWorkers` in place of the supervisor: a launch is validated and fenced as the agent does, records the
  ranks and "runs" them for as long as the job's command asks (`sleep N`), then reports each rank's exit 0
  through the ExitReporter; a stop ends them at once and reports them killed. While they run they are in
  the beats' `running`, as the supervisor's are.

A node chosen to go silent reaches the scheduler through a proxy of its own (`trainyard_core.testing.blackhole`):
once cut it forwards nothing either way and closes nothing, so the scheduler sees neither data nor a FIN; the
node's own AgentService stops answering too. Nothing else differs from the other nodes.

The worker fence's lease file is not written (`lease_path=None`): renewing thousands of files four times a
second is the swarm's cost, not the scheduler's, and no worker reads it here. The Reporter still wakes to
"renew" it every `report.LEASE_RENEW_S` (0.25 s) while its stream is open, which with no file does nothing but
cost a swarm of 500 nodes about 150 us per node-second, half of all it spends; `serve` stretches that period
in the swarm processes only (`_quiet_lease_renewals`). Nothing the scheduler sees changes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc.aio

from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard_agent import report
from trainyard_agent.app import scheduler_channel
from trainyard_agent.grpc import convert
from trainyard_agent.grpc.servicer import SERVICE_NAME
from trainyard_agent.health.book import HealthBook
from trainyard_agent.model import NodeInfo, RunningAllocation
from trainyard_agent.notify import Notifier
from trainyard_agent.report import Backoff, ExitReporter, NodeView, Reporter
from trainyard_agent.settings import AgentSettings
from trainyard_agent.workers.fence import LeaderFence
from trainyard_agent.workers.model import LaunchRequest, LaunchResult, WorkerExit, check_job_id
from trainyard_core import logs
from trainyard_core.errors import FailedPrecondition, NotFound
from trainyard_core.rpc.server import GrpcServer, start_grpc_server
from trainyard_core.security import identity, pki
from trainyard_core.security.pki import CertFiles
from trainyard_core.security.tls import ClientTls
from trainyard_core.testing.blackhole import BlackholeProxy

from ._swarm import SwarmSpec, accelerators, cpu_s, node_info, rss_mb, topology_labels

log = logging.getLogger(__name__)

_DEFAULTS = AgentSettings.model_fields
# The agent's own defaults: its beat interval when the scheduler names none, its reconnect backoff.
INTERVAL_S = float(_DEFAULTS["heartbeat_interval_s"].default)
RECONNECT_S = (float(_DEFAULTS["reconnect_initial_s"].default), float(_DEFAULTS["reconnect_max_s"].default))
FAKE_PID_BASE = 100_000
# How often a swarm agent's Reporter "renews" the lease it has no file for (see the module docstring).
IDLE_RENEW_S = 3600.0
# The niceness of a swarm process (serve): the simulated fleet runs below the control plane it drives.
SWARM_NICE = 10


def planned_seconds(command: tuple[str, ...]) -> float | None:
    """How long a launched job "runs": N for `sleep N`; None (until stopped) for anything else."""
    if len(command) == 2 and command[0] == "sleep":
        try:
            seconds = float(command[1])
        except ValueError:
            return None
        return seconds if seconds >= 0 else None
    return None


@dataclass
class _Run:
    ranks: tuple[int, ...]
    timer: asyncio.TimerHandle | None


class SimWorkers:
    """The supervisor's part, by timers. Idempotent per (job, attempt) like the supervisor; `changes` is
    notified whenever what runs changes (the reporter beats then)."""

    def __init__(self, fence: LeaderFence, submit_exit: Callable[[WorkerExit], None]) -> None:
        self.fence = fence
        self._submit_exit = submit_exit
        self._runs: dict[tuple[str, int], _Run] = {}
        self.changes = Notifier()
        self.launches = 0

    def launch(self, req: LaunchRequest) -> LaunchResult:
        req.validate()
        self.fence.check(req.leader_epoch)
        key = (req.job_id, req.attempt)
        pids = tuple(FAKE_PID_BASE + w.rank for w in req.workers)
        if key in self._runs:
            return LaunchResult(pids=pids, already_running=True)
        seconds = planned_seconds(req.command)
        timer = (asyncio.get_running_loop().call_later(seconds, self._end, key, 0, 0)
                 if seconds is not None else None)
        self._runs[key] = _Run(tuple(w.rank for w in req.workers), timer)
        self.launches += 1
        self.changes.notify()
        return LaunchResult(pids=pids, already_running=False)

    def stop(self, job_id: str, attempt: int, sig: signal.Signals) -> int:
        """Every attempt of the job when `attempt` is 0, as the supervisor does; returns the workers stopped."""
        check_job_id(job_id)
        keys = [k for k in self._runs if k[0] == job_id and (attempt == 0 or k[1] == attempt)]
        stopped = 0
        for key in keys:
            stopped += len(self._runs[key].ranks)
            self._end(key, 128 + int(sig), int(sig))
        return stopped

    def renew(self, job_id: str, attempt: int, leader_epoch: int) -> int:
        """A credential renewal for a running attempt: the workers that would read it. Refused for a bad job id,
        a stale leader epoch, another attempt or no workers, with the agent's codes. The credential itself is
        neither checked nor written: a simulated worker saves no checkpoint."""
        check_job_id(job_id)
        self.fence.check(leader_epoch)
        run = self._runs.get((job_id, attempt))
        if run is not None:
            return len(run.ranks)
        if any(k[0] == job_id for k in self._runs):
            raise FailedPrecondition(f"job {job_id} runs another attempt here, not {attempt}")
        raise NotFound(f"job {job_id} has no workers on this node")

    def running(self) -> list[RunningAllocation]:
        return [RunningAllocation(job_id, attempt, run.ranks) for (job_id, attempt), run in self._runs.items()]

    def _end(self, key: tuple[str, int], code: int, sig: int) -> None:
        run = self._runs.pop(key, None)
        if run is None:
            return
        if run.timer is not None:
            run.timer.cancel()
        now = time.time()
        for rank in run.ranks:
            self._submit_exit(WorkerExit(job_id=key[0], attempt=key[1], rank=rank, exit_code=code, signal=sig,
                                         exited_at=now))
        self.changes.notify()


class SimAgentServicer(agent_pb2_grpc.AgentServiceServicer):
    """The launch and stop the scheduler calls, and what runs; no logs (nothing prints) and no GPU faults."""

    def __init__(self, workers: SimWorkers, silenced: asyncio.Event) -> None:
        self._workers = workers
        self._silenced = silenced

    async def _unless_silent(self) -> None:
        if self._silenced.is_set():
            await asyncio.Event().wait()  # a blackholed host answers nothing; the caller's deadline ends it

    async def LaunchWorkers(self, request: agent_pb2.LaunchWorkersRequest,
                            context: grpc.aio.ServicerContext) -> agent_pb2.LaunchWorkersResponse:
        await self._unless_silent()
        return convert.launch_result_to_pb(self._workers.launch(convert.launch_from_pb(request)))

    async def StopWorkers(self, request: agent_pb2.StopWorkersRequest,
                          context: grpc.aio.ServicerContext) -> agent_pb2.StopWorkersResponse:
        await self._unless_silent()
        if request.leader_epoch:
            self._workers.fence.check(request.leader_epoch)
        stopped = self._workers.stop(request.job_id, request.attempt, convert.stop_signal_from_pb(request.signal))
        return agent_pb2.StopWorkersResponse(stopped=stopped)

    async def RenewJobCredential(self, request: agent_pb2.RenewJobCredentialRequest,
                                 context: grpc.aio.ServicerContext) -> agent_pb2.RenewJobCredentialResponse:
        await self._unless_silent()
        return agent_pb2.RenewJobCredentialResponse(
            workers=self._workers.renew(request.job_id, request.attempt, request.leader_epoch))

    async def ListWorkers(self, request: agent_pb2.ListWorkersRequest,
                          context: grpc.aio.ServicerContext) -> agent_pb2.ListWorkersResponse:
        await self._unless_silent()
        return agent_pb2.ListWorkersResponse(workers=[
            agent_pb2.WorkerStatus(job_id=r.job_id, attempt=r.attempt, rank=rank, pid=FAKE_PID_BASE + rank,
                                   running=True) for r in self._workers.running() for rank in r.ranks])

    async def GetWorkerLogs(self, request: agent_pb2.GetWorkerLogsRequest,
                            context: grpc.aio.ServicerContext) -> agent_pb2.GetWorkerLogsResponse:
        await self._unless_silent()
        return agent_pb2.GetWorkerLogsResponse()  # a simulated worker prints nothing

    async def StreamWorkerLogs(self, request: agent_pb2.GetWorkerLogsRequest,
                               context: grpc.aio.ServicerContext) -> AsyncIterator[agent_pb2.LogChunk]:
        await self._unless_silent()
        return
        yield  # an async generator that ends at once: nothing to follow

    async def InjectFault(self, request: agent_pb2.InjectFaultRequest,
                          context: grpc.aio.ServicerContext) -> agent_pb2.InjectFaultResponse:
        raise FailedPrecondition("a swarm node has no fake NVML: GPU faults are not simulated here")

    async def SetGpuHealth(self, request: agent_pb2.SetGpuHealthRequest,
                           context: grpc.aio.ServicerContext) -> agent_pb2.SetGpuHealthResponse:
        raise FailedPrecondition("a swarm node has no fake NVML: GPU health is not simulated here")


class SimAgent:
    """One simulated node: `start()`, `silence()` (only behind a proxy), `stop()` (a clean agent stop)."""

    def __init__(self, node_id: str, index: int, files: CertFiles, scheduler_address: str,
                 behind_proxy: bool) -> None:
        self.node_id = node_id
        self._labels = topology_labels(index)
        self._files = files
        self._scheduler_address = scheduler_address
        host, _, port = scheduler_address.split(",")[0].rpartition(":")
        self.proxy = BlackholeProxy(host, int(port)) if behind_proxy else None
        self.health = HealthBook(accelerators(node_id))
        self.fence = LeaderFence()
        self.silenced = asyncio.Event()
        self._address = ""
        self.server: GrpcServer | None = None
        self.exits: ExitReporter | None = None
        self.reporter: Reporter | None = None
        self.workers = SimWorkers(self.fence, self._submit_exit)

    def _submit_exit(self, exit: WorkerExit) -> None:
        assert self.exits is not None
        self.exits.submit(exit)

    def node_info(self) -> NodeInfo:
        return node_info(self.node_id, self._address, self._labels, self.health.all())

    async def start(self) -> None:
        servicer = SimAgentServicer(self.workers, self.silenced)
        self.server = await start_grpc_server(
            host="127.0.0.1", port=0, service_names=[SERVICE_NAME], tls=self._files,
            register=lambda server: agent_pb2_grpc.add_AgentServiceServicer_to_server(servicer, server))
        self._address = f"127.0.0.1:{self.server.port}"
        report_to = (await self.proxy.start()).address if self.proxy is not None else self._scheduler_address
        tls = ClientTls(self._files)
        self.exits = ExitReporter(node_id=self.node_id, connect=scheduler_channel(report_to, tls),
                                  backoff=Backoff(*RECONNECT_S))
        self.reporter = Reporter(
            node_id=self.node_id, connect=scheduler_channel(report_to, tls), fence=self.fence,
            interval_s=INTERVAL_S, backoff=Backoff(*RECONNECT_S),
            view=NodeView(node_info=self.node_info, running=self.workers.running, health=self.health,
                          changes=self.workers.changes))
        self.exits.start()
        self.reporter.start()

    @property
    def registrations(self) -> int:
        return self.reporter.registrations if self.reporter is not None else 0

    def silence(self) -> None:
        if self.proxy is None:
            raise ValueError(f"{self.node_id} was not started behind a proxy: it cannot go silent")
        self.proxy.cut()
        self.silenced.set()

    async def stop(self) -> None:
        for part in (self.reporter, self.exits):
            if part is not None:
                await part.stop()
        if self.server is not None:
            await self.server.stop(grace=0)
        if self.proxy is not None:
            await self.proxy.close()


class SwarmProcess:
    """The nodes of one swarm process and the requests of `_swarm`'s protocol."""

    def __init__(self, spec: SwarmSpec) -> None:
        self.spec = spec
        self._index = dict(spec.nodes)
        self.agents: dict[str, SimAgent] = {}

    async def handle(self, request: tuple[Any, ...]) -> Any:
        kind = request[0]
        if kind == "start":
            return await self.start(list(request[1]), float(request[2]), float(request[3]))
        if kind == "silence":
            return self.silence(list(request[1]))
        if kind == "stats":
            return self.stats()
        if kind == "stop":
            await self.stop()
            return ("stopped",)
        raise ValueError(f"unknown request {kind!r}")

    async def start(self, ids: list[str], per_s: float, wait_s: float) -> dict[str, Any]:
        unknown = [n for n in ids if n not in self._index]
        if unknown:
            raise ValueError(f"not this swarm's nodes: {unknown[:5]}")
        loop = asyncio.get_running_loop()
        began = loop.time()
        for k, node_id in enumerate(ids):
            delay = began + k / per_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)  # the pace of the ramp, not a synchronisation
            files = pki.files_for(Path(self.spec.pki_dir), identity.node(node_id))
            agent = SimAgent(node_id, self._index[node_id], files, self.spec.scheduler_address,
                             node_id in self.spec.behind_proxy)
            self.agents[node_id] = agent
            await agent.start()
        deadline = loop.time() + wait_s
        # Polled: the reporter has no event for "registered", only its count.
        while loop.time() < deadline and any(self.agents[n].registrations == 0 for n in ids):  # noqa: ASYNC110
            await asyncio.sleep(0.2)
        missing = [n for n in ids if self.agents[n].registrations == 0]
        return {"registered": len(ids) - len(missing), "missing": missing[:10]}

    def silence(self, ids: list[str]) -> dict[str, float]:
        at = {}
        for node_id in ids:
            self.agents[node_id].silence()
            at[node_id] = time.monotonic()
        return at

    def stats(self) -> dict[str, Any]:
        return {
            "nodes": len(self.agents),
            "registrations": {n: a.registrations for n, a in self.agents.items()},
            "launches": sum(a.workers.launches for a in self.agents.values()),
            "exits_reported": sum(a.exits.sent for a in self.agents.values() if a.exits is not None),
            "cpu_s": cpu_s(os.getpid()),
            "rss_mb": rss_mb(os.getpid()),
        }

    async def stop(self) -> None:
        agents, self.agents = list(self.agents.values()), {}
        await asyncio.gather(*(a.stop() for a in agents), return_exceptions=True)


def serve(conn: Connection, spec: SwarmSpec) -> None:
    """A swarm process's entry point: answer the parent's requests until it says stop or goes away. Its
    stderr (its log, and gRPC's own lines) goes to `spec.log_path` when one is given."""
    if spec.log_path:
        fd = os.open(spec.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
    logs.setup_logging(f"swarm-{spec.name}", level=spec.log_level, fmt="json")
    _quiet_lease_renewals()
    # The simulated hosts yield the CPU to the control plane under test, whose own machines they would not share
    # in a fleet: without it, at a failover thousands of simulated agents' TLS handshakes starved etcd and the
    # new leader on this machine's 2 cores (leases lost to etcd answering nobody for 3 s).
    os.nice(SWARM_NICE)
    asyncio.run(_serve(conn, spec))


def _quiet_lease_renewals() -> None:
    """The Reporter renews its lease on a timer even without a lease file (`lease_path=None`); in a swarm
    process, where no agent has one, the timer runs once an hour instead. If report.py no longer has the
    period, the swarm only costs more."""
    if isinstance(getattr(report, "LEASE_RENEW_S", None), float):
        setattr(report, "LEASE_RENEW_S", IDLE_RENEW_S)  # noqa: B010 - the name is checked just above


async def _serve(conn: Connection, spec: SwarmSpec) -> None:
    process = SwarmProcess(spec)
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    tasks: set[asyncio.Task[None]] = set()

    async def answer(request: tuple[Any, ...]) -> None:
        try:
            reply = await process.handle(request)
        except Exception as exc:  # the parent names the failed request; the swarm keeps serving
            log.exception("swarm request failed", extra={"request": str(request[0])})
            reply = ("error", f"{type(exc).__name__}: {exc}")
        conn.send(reply)
        if request[0] == "stop":
            done.set()

    def readable() -> None:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            done.set()
            return
        task = loop.create_task(answer(request))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    loop.add_reader(conn.fileno(), readable)
    try:
        await done.wait()
    finally:
        loop.remove_reader(conn.fileno())
        await process.stop()
