"""What the gateway's and the CLI's tests run against: the real services on free ports.

- `running_gateway`: a GatewayApp with a fresh bootstrap (operator) token.
- `Cluster`: a real SchedulerApp on its own etcd prefix and real AgentApps on simulated GPUs (the fake
  NVML of `--gpu-profile`, the only stand-in the project allows). Agents can be added, stopped and
  replaced while a test runs, and so can the scheduler be stopped: that is how "node unreachable" and
  "scheduler unavailable" are produced.
- `CallLog`: the unary requests a real scheduler or agent received, and apart from them its server-streaming
  ones (and how many of those are open now), recorded by one more server interceptor (the shared bootstrap
  `start_grpc_server` takes extra ones). Tests read it to check what
  the gateway sent (team scoping, idempotency keys, no call at all for bad input) and to wait for a CLI
  that polls. Left out: the cluster's own helper calls (they carry `HELPER_METADATA`) and the calls
  between the scheduler and its agents.
"""

from __future__ import annotations

import contextlib
import sys
import textwrap
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

import grpc
import grpc.aio
import httpx
from pydantic import SecretStr

import trainyard_agent.app as agent_app_module
import trainyard_scheduler.app as scheduler_app_module
from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_agent.app import AgentApp
from trainyard_agent.settings import AgentSettings
from trainyard_core.rpc.server import insecure_channel
from trainyard_core.testing.wait import eventually
from trainyard_gateway.app import GatewayApp
from trainyard_gateway.settings import GatewaySettings
from trainyard_gateway.tokens import new_secret
from trainyard_scheduler.app import SchedulerApp
from trainyard_scheduler.settings import SchedulerSettings

# Short timers: placement within a cycle of 0.2 s, heartbeats every 0.2 s (agents take the interval the
# scheduler gives them at registration), a node lost after 3 s without one, workers SIGKILLed 1 s after
# SIGTERM.
SCHEDULER_SETTINGS: dict[str, Any] = {"leader_ttl_s": 2, "reconcile_interval_s": 0.2, "stop_grace_s": 1.0,
                                      "heartbeat_interval_ms": 200, "node_timeout_s": 3.0}
HELPER_METADATA = (("trainyard-test-helper", "1"),)
# Calls between the scheduler and its agents, left out of the call logs: what remains is what the gateway
# (or any other client) asked.
AGENT_TO_SCHEDULER = frozenset({"RegisterNode", "Beat", "ReportWorkerExit"})
SCHEDULER_TO_AGENT = frozenset({"LaunchWorkers", "StopWorkers"})


# --- the gateway -----------------------------------------------------------------------------------

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

    async def create_token(self, team: str, user: str, *, role: str = "member", **more: Any) -> str:
        """A new token made with the bootstrap (operator) token. `more`: ttl, scopes, description."""
        async with self.client(self.admin_token) as http:
            reply = await http.post("/v1/tokens", json={"team": team, "user": user, "role": role, **more})
        reply.raise_for_status()
        return str(reply.json()["secret"])


@contextlib.asynccontextmanager
async def running_gateway(*, etcd: Mapping[str, str], etcd_prefix: str, scheduler_address: str,
                          **overrides: Any) -> AsyncIterator[RunningGateway]:
    """A GatewayApp on free ports with a fresh bootstrap (operator) token; `etcd` its etcd settings (the
    `etcd_settings` fixture)."""
    admin = new_secret()
    settings = GatewaySettings(**etcd, etcd_prefix=etcd_prefix, http_port=0, grpc_port=0,
                               scheduler_address=scheduler_address,
                               bootstrap_admin_token=SecretStr(admin), **overrides)
    app = GatewayApp(settings)
    await app.start()
    try:
        yield RunningGateway(app=app, admin_token=admin)
    finally:
        await app.stop()


# --- what a real service was asked --------------------------------------------------------------------

@dataclass
class CallLog:
    """(method, request) of every unary call a service received, in arrival order, but for the methods
    in `ignore`; `streams` the same of its server-streaming calls, and `open_streams` method → how many of
    them have not ended yet."""

    ignore: frozenset[str] = frozenset()
    calls: list[tuple[str, Any]] = field(default_factory=list)
    # Unary methods answered UNIMPLEMENTED (after being recorded), as a server of an older version would.
    unimplemented: frozenset[str] = frozenset()
    streams: list[tuple[str, Any]] = field(default_factory=list)
    open_streams: Counter[str] = field(default_factory=Counter)

    @property
    def methods(self) -> list[str]:
        return [method for method, _ in self.calls]

    def requests(self, method: str) -> list[Any]:
        return [request for m, request in self.calls if m == method]

    def submits(self) -> list[Any]:
        """The SubmitJobRequests received, whether each was a SubmitJob call or an item of a SubmitJobs batch."""
        out: list[Any] = []
        for m, request in self.calls:
            if m == "SubmitJob":
                out.append(request)
            elif m == "SubmitJobs":
                out.extend(item.request for item in request.items)
        return out

    def stream_requests(self, method: str) -> list[Any]:
        return [request for m, request in self.streams if m == method]

    def clear(self) -> None:
        self.calls.clear()


class _Recorder(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Records each unary or server-streaming request before the servicer sees it, and counts the streams
    until their handler ends (finished, failed or cancelled); changes nothing about the call."""

    def __init__(self, log: CallLog) -> None:
        self._log = log

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or (handler.unary_unary is None and handler.unary_stream is None):
            return handler
        if any((md.key, md.value) in HELPER_METADATA for md in details.invocation_metadata or ()):
            return handler
        method = details.method.rsplit("/", 1)[-1]
        if method in self._log.ignore:
            return handler
        log = self._log
        if handler.unary_stream is not None:
            streaming = handler.unary_stream

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                log.streams.append((method, request))
                log.open_streams[method] += 1
                try:
                    replies = streaming(request, context)
                    if hasattr(replies, "__aiter__"):
                        async for reply in replies:
                            yield reply
                    else:  # a handler that writes with context.write() instead of yielding
                        await replies
                finally:
                    log.open_streams[method] -= 1

            return grpc.unary_stream_rpc_method_handler(stream, handler.request_deserializer,
                                                        handler.response_serializer)
        behavior = handler.unary_unary

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            log.calls.append((method, request))
            if method in log.unimplemented:
                await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
            return await behavior(request, context)

        return grpc.unary_unary_rpc_method_handler(call, handler.request_deserializer,
                                                   handler.response_serializer)


@contextlib.contextmanager
def _recorded(app_module: ModuleType, log: CallLog) -> Iterator[None]:
    """While a service's `start()` runs, its gRPC server is built with the recorder added."""
    original = app_module.start_grpc_server

    def start_grpc_server(**kwargs: Any) -> Any:
        kwargs["interceptors"] = [*kwargs.get("interceptors", ()), _Recorder(log)]
        return original(**kwargs)

    with mock.patch.object(app_module, "start_grpc_server", start_grpc_server):
        yield


# --- workers ------------------------------------------------------------------------------------------

def python(*snippets: str) -> list[str]:
    """A worker command: this interpreter running the snippets (each dedented) one after the other,
    unbuffered, so every line reaches the rank's log as it is printed."""
    code = "\n".join(textwrap.dedent(s).strip("\n") for s in snippets)
    return [sys.executable, "-u", "-c", code]


def wait_for_file(path: Path, timeout_s: float = 60.0) -> str:
    """A worker snippet that blocks until the test creates `path` (exit 9 after `timeout_s`): how a test
    lets a running worker go on at the moment it chooses."""
    return (f"import pathlib, sys, time\n"
            f"deadline = time.monotonic() + {timeout_s}\n"
            f"while not pathlib.Path({str(path)!r}).exists():\n"
            f"    time.sleep(0.02)\n"
            f"    if time.monotonic() > deadline:\n"
            f"        sys.exit(9)\n")


# --- scheduler and agents -----------------------------------------------------------------------------

class Cluster:
    """A real scheduler on `prefix` and the real node agents added to it (state under `state_root`)."""

    def __init__(self, *, etcd: Mapping[str, str], prefix: str, state_root: Path, **scheduler_settings: Any) -> None:
        self.settings = SchedulerSettings(**etcd, etcd_prefix=prefix.rstrip("/"),
                                          listen_port=0, **{**SCHEDULER_SETTINGS, **scheduler_settings})
        self.state_root = state_root
        self.scheduler = SchedulerApp(self.settings)
        self.calls = CallLog(ignore=AGENT_TO_SCHEDULER)
        self.agents: dict[str, AgentApp] = {}
        self.agent_calls: dict[str, CallLog] = {}
        self._scheduler_running = False
        self._channel: grpc.aio.Channel | None = None
        self._jobs: scheduler_pb2_grpc.JobServiceAsyncStub | None = None
        self._nodes: scheduler_pb2_grpc.NodeServiceAsyncStub | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.scheduler.grpc_port}"

    async def start(self) -> None:
        with _recorded(scheduler_app_module, self.calls):
            await self.scheduler.start()
        self._scheduler_running = True
        self._channel = insecure_channel(self.address)
        self._jobs = scheduler_pb2_grpc.JobServiceStub(self._channel)  # type: ignore[assignment]
        self._nodes = scheduler_pb2_grpc.NodeServiceStub(self._channel)  # type: ignore[assignment]

    async def stop_scheduler(self) -> None:
        if self._scheduler_running:
            self._scheduler_running = False
            await self.scheduler.stop()

    async def stop(self) -> None:
        for node_id in list(self.agents):
            await self.stop_agent(node_id)
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
        await self.stop_scheduler()

    # agents

    async def add_agent(self, node_id: str, profile: str = "a100x4", *, state_dir: Path | None = None) -> AgentApp:
        """Start a node agent and wait until the scheduler lists its node as ready at its address."""
        settings = AgentSettings(node_id=node_id, gpu_profile=profile, scheduler_address=self.address,
                                 state_dir=str(state_dir or self.state_root / node_id),
                                 heartbeat_interval_s=0.2, stop_grace_s=1.0, single_tenant=True)
        app = AgentApp(settings)
        with _recorded(agent_app_module, self.agent_calls.setdefault(node_id, CallLog(ignore=SCHEDULER_TO_AGENT))):
            await app.start()
        self.agents[node_id] = app
        address = f"127.0.0.1:{app.grpc_port}"

        async def ready() -> bool:
            return any(n.node_id == node_id and n.agent_address == address and n.state == types_pb2.NODE_STATE_READY
                       for n in await self.list_nodes())

        await eventually(ready, timeout=15, what=f"node {node_id} to be registered and ready")
        return app

    async def stop_agent(self, node_id: str) -> None:
        """Stop the agent (its workers killed); the node stays registered, its address unreachable."""
        await self.agents.pop(node_id).stop(kill_workers=True)

    async def inject_fault(self, node_id: str, gpu_index: int, kind: str, xid: int = 0) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.agents[node_id].grpc_port}") as channel:
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            await stub.InjectFault(agent_pb2.InjectFaultRequest(gpu_index=gpu_index, kind=kind, xid=xid),
                                   metadata=HELPER_METADATA)

    # the scheduler's API, as a test sees it (left out of `calls`)

    @property
    def jobs(self) -> scheduler_pb2_grpc.JobServiceAsyncStub:
        assert self._jobs is not None, "cluster not started"
        return self._jobs

    async def list_nodes(self) -> list[types_pb2.Node]:
        assert self._nodes is not None, "cluster not started"
        try:
            reply = await self._nodes.ListNodes(scheduler_pb2.ListNodesRequest(), metadata=HELPER_METADATA)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:  # not leading yet: only the leader knows the nodes
                return []
            raise
        return list(reply.nodes)

    async def submit(self, command: list[str], *, name: str = "job", nodes: int = 1, gpus: int = 1,
                     team: str = "vision", user: str = "alice", accelerator: str = "") -> types_pb2.Job:
        spec = types_pb2.JobSpec(name=name, command=command, resources=types_pb2.Resources(
            nodes=nodes, gpus_per_node=gpus, accelerator=accelerator))
        reply = await self.jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec, team=team, user=user),
                                          metadata=HELPER_METADATA)
        job: types_pb2.Job = reply.job
        return job

    async def list_jobs(self) -> list[types_pb2.Job]:
        """Every job of every team (one page of up to 500, plenty for a test)."""
        reply = await self.jobs.ListJobs(scheduler_pb2.ListJobsRequest(page_size=500), metadata=HELPER_METADATA)
        return list(reply.jobs)

    async def job(self, job_id: str) -> types_pb2.Job:
        reply = await self.jobs.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id), metadata=HELPER_METADATA)
        job: types_pb2.Job = reply.job
        return job

    async def wait_state(self, job_id: str, *states: int, timeout: float = 30.0) -> types_pb2.Job:
        async def reached() -> types_pb2.Job | None:
            job = await self.job(job_id)
            return job if job.state in states else None

        names = "/".join(types_pb2.JobState.Name(s) for s in states)  # type: ignore[arg-type]
        return await eventually(reached, timeout=timeout, what=f"job {job_id} to be {names}")


@contextlib.asynccontextmanager
async def running_cluster(*, etcd: Mapping[str, str], prefix: str, state_root: Path,
                          agents: dict[str, str] | None = None, **scheduler_settings: Any) -> AsyncIterator[Cluster]:
    """A started Cluster with `agents` (node id → GPU profile) registered and ready; stopped at exit."""
    cluster = Cluster(etcd=etcd, prefix=prefix, state_root=state_root, **scheduler_settings)
    try:
        await cluster.start()
        for node_id, profile in (agents or {}).items():
            await cluster.add_agent(node_id, profile)
        yield cluster
    finally:
        await cluster.stop()
