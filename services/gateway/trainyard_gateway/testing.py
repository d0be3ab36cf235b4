"""Helpers for the gateway's and the CLI's tests and benchmarks: a gateway on free ports, and small
stand-ins for the scheduler and node agents served over real gRPC (on port 0, through the shared
server bootstrap and its error-mapping interceptor), for tests of the gateway's own behaviour (routing,
error mapping, team scoping, log merging) that must not depend on the real scheduler's policies.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc.aio
import httpx
from google.protobuf.timestamp_pb2 import Timestamp
from pydantic import SecretStr

from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_core.errors import NotFound, TrainyardError
from trainyard_core.ids import new_id
from trainyard_core.rpc.server import GrpcServer, start_grpc_server

from .app import GatewayApp
from .settings import GatewaySettings
from .tokens import new_secret

TERMINAL = (types_pb2.JOB_STATE_SUCCEEDED, types_pb2.JOB_STATE_FAILED, types_pb2.JOB_STATE_CANCELLED)


def _now() -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(time.time_ns())
    return ts


@dataclass
class RunningGateway:
    app: GatewayApp
    admin_token: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.app.http_port}"

    def client(self, token: str | None = None) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=30.0)

    async def create_token(self, team: str, user: str, *, admin: bool = False) -> str:
        async with self.client(self.admin_token) as http:
            reply = await http.post("/v1/tokens", json={"team": team, "user": user, "admin": admin})
        reply.raise_for_status()
        return str(reply.json()["secret"])


@contextlib.asynccontextmanager
async def running_gateway(*, etcd_endpoints: str, etcd_prefix: str, scheduler_address: str,
                          **overrides: Any) -> AsyncIterator[RunningGateway]:
    """A GatewayApp on free ports with a fresh bootstrap admin token."""
    admin = new_secret()
    settings = GatewaySettings(etcd_endpoints=etcd_endpoints, etcd_prefix=etcd_prefix, http_port=0, grpc_port=0,
                               scheduler_address=scheduler_address,
                               bootstrap_admin_token=SecretStr(admin), **overrides)
    app = GatewayApp(settings)
    await app.start()
    try:
        yield RunningGateway(app=app, admin_token=admin)
    finally:
        await app.stop()


@dataclass
class StubScheduler(scheduler_pb2_grpc.JobServiceServicer, scheduler_pb2_grpc.NodeServiceServicer):
    """Keeps jobs in a dict; honours `team` like the real scheduler (other teams' jobs are not found).
    `fail` maps a job id to the domain error its calls raise. `calls` records (method, request)."""

    jobs: dict[str, types_pb2.Job] = field(default_factory=dict)
    nodes: list[types_pb2.Node] = field(default_factory=list)
    fail: dict[str, TrainyardError] = field(default_factory=dict)
    calls: list[tuple[str, Any]] = field(default_factory=list)
    _keys: dict[str, str] = field(default_factory=dict)
    server: GrpcServer | None = None

    @property
    def address(self) -> str:
        assert self.server is not None
        return f"127.0.0.1:{self.server.port}"

    async def start(self) -> None:
        def register(server: grpc.aio.Server) -> None:
            scheduler_pb2_grpc.add_JobServiceServicer_to_server(self, server)
            scheduler_pb2_grpc.add_NodeServiceServicer_to_server(self, server)
        self.server = await start_grpc_server(
            host="127.0.0.1", port=0, register=register,
            service_names=["trainyard.scheduler.v1.JobService", "trainyard.scheduler.v1.NodeService"])

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=0.5)

    def add_job(self, *, team: str, user: str = "someone", name: str = "stub-job",
                state: int = types_pb2.JOB_STATE_PENDING, job_id: str = "", **fields: Any) -> types_pb2.Job:
        job = types_pb2.Job(id=job_id or new_id("job"), team=team, user=user, state=state,  # type: ignore[arg-type]
                            spec=types_pb2.JobSpec(name=name, command=["true"],
                                                   resources=types_pb2.Resources(nodes=1, gpus_per_node=1)),
                            created_at=_now(), updated_at=_now(), attempt=1, **fields)
        self.jobs[job.id] = job
        return job

    def _visible(self, job_id: str, team: str) -> types_pb2.Job:
        if job_id in self.fail:
            raise self.fail[job_id]
        job = self.jobs.get(job_id)
        if job is None or (team and job.team != team):
            raise NotFound(f"job {job_id} not found")
        return job

    async def SubmitJob(self, request: scheduler_pb2.SubmitJobRequest,
                        context: grpc.aio.ServicerContext) -> scheduler_pb2.SubmitJobResponse:
        self.calls.append(("SubmitJob", request))
        if request.spec.name in self.fail:
            raise self.fail[request.spec.name]
        if request.idempotency_key and request.idempotency_key in self._keys:
            return scheduler_pb2.SubmitJobResponse(job=self.jobs[self._keys[request.idempotency_key]])
        job = types_pb2.Job(id=new_id("job"), spec=request.spec, team=request.team, user=request.user,
                            state=types_pb2.JOB_STATE_PENDING, created_at=_now(), updated_at=_now(), attempt=1)
        self.jobs[job.id] = job
        if request.idempotency_key:
            self._keys[request.idempotency_key] = job.id
        return scheduler_pb2.SubmitJobResponse(job=job)

    async def GetJob(self, request: scheduler_pb2.GetJobRequest,
                     context: grpc.aio.ServicerContext) -> scheduler_pb2.GetJobResponse:
        self.calls.append(("GetJob", request))
        return scheduler_pb2.GetJobResponse(job=self._visible(request.job_id, request.team))

    async def ListJobs(self, request: scheduler_pb2.ListJobsRequest,
                       context: grpc.aio.ServicerContext) -> scheduler_pb2.ListJobsResponse:
        self.calls.append(("ListJobs", request))
        jobs = sorted((j for j in self.jobs.values()
                       if (not request.team or j.team == request.team)
                       and (not request.states or j.state in request.states)), key=lambda j: j.id)
        start = int(request.page_token or 0)
        size = request.page_size or 50
        page = jobs[start:start + size]
        more = start + size < len(jobs)
        return scheduler_pb2.ListJobsResponse(jobs=page, next_page_token=str(start + size) if more else "")

    async def CancelJob(self, request: scheduler_pb2.CancelJobRequest,
                        context: grpc.aio.ServicerContext) -> scheduler_pb2.CancelJobResponse:
        self.calls.append(("CancelJob", request))
        job = self._visible(request.job_id, request.team)
        if job.state not in TERMINAL:
            job.state = types_pb2.JOB_STATE_CANCELLED
            job.cancel_requested = True
            job.message = request.reason or "cancelled"
        return scheduler_pb2.CancelJobResponse(job=job)

    async def ListNodes(self, request: scheduler_pb2.ListNodesRequest,
                        context: grpc.aio.ServicerContext) -> scheduler_pb2.ListNodesResponse:
        self.calls.append(("ListNodes", request))
        return scheduler_pb2.ListNodesResponse(nodes=self.nodes)


@dataclass
class StubAgent(agent_pb2_grpc.AgentServiceServicer):
    """Answers GetWorkerLogs from `lines` (job_id → lines), keeping the last `tail_lines` of each rank;
    NOT_FOUND for a job it has no lines of, as an agent that never ran the job does."""

    lines: dict[str, list[agent_pb2.LogLine]] = field(default_factory=dict)
    calls: list[agent_pb2.GetWorkerLogsRequest] = field(default_factory=list)
    server: GrpcServer | None = None

    @property
    def address(self) -> str:
        assert self.server is not None
        return f"127.0.0.1:{self.server.port}"

    async def start(self) -> None:
        self.server = await start_grpc_server(
            host="127.0.0.1", port=0, service_names=["trainyard.agent.v1.AgentService"],
            register=lambda server: agent_pb2_grpc.add_AgentServiceServicer_to_server(self, server))

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=0.5)

    async def GetWorkerLogs(self, request: agent_pb2.GetWorkerLogsRequest,
                            context: grpc.aio.ServicerContext) -> agent_pb2.GetWorkerLogsResponse:
        self.calls.append(request)
        if request.job_id not in self.lines:
            raise NotFound(f"job {request.job_id} has no workers on this node")
        lines = [ln for ln in self.lines[request.job_id]
                 if not request.attempt or ln.attempt == request.attempt]
        if request.tail_lines:
            kept: list[agent_pb2.LogLine] = []
            for rank in sorted({ln.rank for ln in lines}):
                kept += [ln for ln in lines if ln.rank == rank][-request.tail_lines:]
            lines = [ln for ln in lines if ln in kept]
        return agent_pb2.GetWorkerLogsResponse(lines=lines)
