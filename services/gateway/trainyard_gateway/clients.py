"""grpc.aio clients of the scheduler (jobs, nodes, queues and quotas) and of the node agents (logs).

They take and return API models (conversion in `convert`), so routers never see protobuf. Every failed
call is turned into the domain error it stands for (`from_rpc_error`), which the gateway's one error
handler maps to an HTTP status. Channels are created here but owned by whoever built the client
(GatewayApp), which closes them.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar, cast

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard.scheduler.v1 import policy_pb2, policy_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from trainyard_core.errors import Unavailable
from trainyard_core.rpc.errors import from_rpc_error
from trainyard_core.rpc.server import insecure_channel

from . import convert
from .schemas.jobs import Job, JobList, JobSubmit
from .schemas.logs import LogLine
from .schemas.nodes import Node
from .schemas.queues import Queue, QueuePut
from .schemas.quotas import Quota, QuotaPut

T = TypeVar("T")
# A NodeService call, given the stub to send it on and the seconds it may take.
NodeCall = Callable[[scheduler_pb2_grpc.NodeServiceStub, float], Awaitable[T]]
LEADER_METADATA = "trainyard-leader"


async def _call(what: str, call: Awaitable[T]) -> T:
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        raise from_rpc_error(exc, what) from exc


class SchedulerClient:
    """JobService, NodeService and PolicyService of the scheduler. `team` empty means: every team (admin
    callers)."""

    def __init__(self, channel: grpc.aio.Channel, *, timeout_s: float,
                 leader_channel: Callable[[str], grpc.aio.Channel] | None = None,
                 replicas: Sequence[str] = ()) -> None:
        self._jobs = scheduler_pb2_grpc.JobServiceStub(channel)
        self._nodes = scheduler_pb2_grpc.NodeServiceStub(channel)
        self._policy = policy_pb2_grpc.PolicyServiceStub(channel)
        self._health = health_pb2_grpc.HealthStub(channel)
        self._timeout = timeout_s
        # Channels to one replica by address (cached by their owner); without it, only `channel` is used.
        self._leader_channel = leader_channel
        # Every configured replica, asked in turn when a refusal does not say who leads.
        self._replicas = list(replicas) if leader_channel is not None else []
        self._stubs: dict[str, scheduler_pb2_grpc.NodeServiceStub] = {}
        # The leader's address, once a replica named it and it answered; '': use the main channel.
        self._leader = ""

    def _stub(self, address: str) -> scheduler_pb2_grpc.NodeServiceStub:
        stub = self._stubs.get(address)
        if stub is None:
            assert self._leader_channel is not None
            stub = self._stubs[address] = scheduler_pb2_grpc.NodeServiceStub(self._leader_channel(address))
        return stub

    async def _on_leader(self, call: NodeCall[T]) -> T:
        """NodeService calls must reach the leader (only it hears the agents' heartbeats). Any replica
        answers job calls, so the main channel may be on a standby, and a standby refuses node calls with
        UNAVAILABLE, naming the leader when it knows it (`trainyard-leader` metadata).

        Asked in order, each at most once, all within one call's deadline: the leader remembered from an
        earlier call, the main channel, then whoever a refusal names, and — when a refusal names nobody (a
        replica that does not know yet, or one that is down) — every configured replica in turn, so a
        leader that exists is found whatever the replica in front of it knows. Node calls are reads and
        the idempotent cordon, so sending one to several replicas is safe; only the leader acts on it."""
        deadline = time.monotonic() + self._timeout
        queue: list[str | None] = [self._leader] if self._leader else []
        queue.append(None)  # None: the main channel
        tried: set[str | None] = set()
        first: grpc.aio.AioRpcError | None = None
        named: grpc.aio.AioRpcError | None = None  # the refusal of a replica another one named as leader
        hinted: set[str] = set()
        while queue:
            target = queue.pop(0)
            if target in tried:
                continue
            tried.add(target)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                result = await call(self._nodes if target is None else self._stub(target), left)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise from_rpc_error(exc, "scheduler") from exc
                first = first or exc
                if target is not None and target in hinted:
                    named = exc
                if target is not None and target == self._leader:
                    self._leader = ""  # it moved or died
                leader = str(dict(exc.trailing_metadata() or ()).get(LEADER_METADATA, ""))
                if leader and self._leader_channel is not None:
                    hinted.add(leader)
                    queue.insert(0, leader)
                elif not leader:
                    queue.extend(r for r in self._replicas if r not in tried)
                continue
            if target is not None:
                self._leader = target
            return result
        last = named or first
        if last is None:
            raise Unavailable(f"no scheduler replica answered within {self._timeout:g}s")
        raise from_rpc_error(last, "scheduler") from last

    async def submit_job(self, spec: JobSubmit, *, team: str, user: str, idempotency_key: str = "") -> Job:
        request = scheduler_pb2.SubmitJobRequest(spec=convert.spec_to_pb(spec), team=team, user=user,
                                                 idempotency_key=idempotency_key)
        reply = await _call("scheduler", self._jobs.SubmitJob(request, timeout=self._timeout))
        return convert.job_from_pb(reply.job)

    async def get_job(self, job_id: str, *, team: str) -> Job:
        request = scheduler_pb2.GetJobRequest(job_id=job_id, team=team)
        reply = await _call("scheduler", self._jobs.GetJob(request, timeout=self._timeout))
        return convert.job_from_pb(reply.job)

    async def list_jobs(self, *, page_size: int, page_token: str, team: str,
                        states: Sequence[str] = ()) -> JobList:
        request = scheduler_pb2.ListJobsRequest(
            page_size=page_size, page_token=page_token, team=team,
            states=[convert.job_state_from_name(s) for s in states])  # type: ignore[misc]
        reply = await _call("scheduler", self._jobs.ListJobs(request, timeout=self._timeout))
        return JobList(jobs=[convert.job_from_pb(j) for j in reply.jobs], next_page_token=reply.next_page_token)

    async def cancel_job(self, job_id: str, *, team: str, reason: str = "") -> Job:
        request = scheduler_pb2.CancelJobRequest(job_id=job_id, team=team, reason=reason)
        reply = await _call("scheduler", self._jobs.CancelJob(request, timeout=self._timeout))
        return convert.job_from_pb(reply.job)

    async def list_nodes(self) -> list[Node]:
        reply = await self._on_leader(lambda nodes, left: nodes.ListNodes(scheduler_pb2.ListNodesRequest(),
                                                                          timeout=left))
        return [convert.node_from_pb(n) for n in reply.nodes]

    async def get_node(self, node_id: str) -> Node:
        reply = await self._on_leader(lambda nodes, left: nodes.GetNode(scheduler_pb2.GetNodeRequest(node_id=node_id),
                                                                        timeout=left))
        return convert.node_from_pb(reply.node)

    async def cordon_node(self, node_id: str, *, cordoned: bool, reason: str) -> Node:
        request = scheduler_pb2.CordonNodeRequest(node_id=node_id, cordoned=cordoned, reason=reason)
        reply = await self._on_leader(lambda nodes, left: nodes.CordonNode(request, timeout=left))
        return convert.node_from_pb(reply.node)

    async def list_queues(self) -> list[Queue]:
        reply = await _call("scheduler", self._policy.ListQueues(policy_pb2.ListQueuesRequest(),
                                                                 timeout=self._timeout))
        return [convert.queue_from_pb(q) for q in reply.queues]

    async def put_queue(self, name: str, body: QueuePut) -> tuple[Queue, bool]:
        request = policy_pb2.PutQueueRequest(queue=convert.queue_to_pb(name, body))
        reply = await _call("scheduler", self._policy.PutQueue(request, timeout=self._timeout))
        return convert.queue_from_pb(reply.queue), reply.created

    async def delete_queue(self, name: str) -> Queue:
        reply = await _call("scheduler", self._policy.DeleteQueue(policy_pb2.DeleteQueueRequest(name=name),
                                                                  timeout=self._timeout))
        return convert.queue_from_pb(reply.queue)

    async def list_quotas(self, *, team: str) -> list[Quota]:
        reply = await _call("scheduler", self._policy.ListQuotas(policy_pb2.ListQuotasRequest(team=team),
                                                                 timeout=self._timeout))
        return [convert.quota_from_pb(q) for q in reply.quotas]

    async def get_quota(self, team: str) -> Quota:
        reply = await _call("scheduler", self._policy.GetQuota(policy_pb2.GetQuotaRequest(team=team),
                                                               timeout=self._timeout))
        return convert.quota_from_pb(reply.quota)

    async def put_quota(self, team: str, body: QuotaPut) -> tuple[Quota, bool]:
        request = policy_pb2.PutQuotaRequest(quota=convert.quota_to_pb(team, body))
        reply = await _call("scheduler", self._policy.PutQuota(request, timeout=self._timeout))
        return convert.quota_from_pb(reply.quota), reply.created

    async def delete_quota(self, team: str) -> Quota:
        reply = await _call("scheduler", self._policy.DeleteQuota(policy_pb2.DeleteQuotaRequest(team=team),
                                                                  timeout=self._timeout))
        return convert.quota_from_pb(reply.quota)

    async def check_health(self, timeout_s: float) -> str:
        """'' when the scheduler answers SERVING, else why not."""
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {exc.details() or 'no answer'}"
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            return f"health status {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
        return ""


class AgentClients:
    """AgentService clients, one channel per agent address, created on first use."""

    def __init__(self, *, timeout_s: float) -> None:
        self._timeout = timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, agent_pb2_grpc.AgentServiceAsyncStub] = {}

    def _stub(self, address: str) -> agent_pb2_grpc.AgentServiceAsyncStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = self._channels[address] = insecure_channel(address)
            stub = self._stubs[address] = cast("agent_pb2_grpc.AgentServiceAsyncStub",
                                               agent_pb2_grpc.AgentServiceStub(channel))
        return stub

    async def worker_logs(self, address: str, *, job_id: str, attempt: int, tail_lines: int) -> list[LogLine]:
        request = agent_pb2.GetWorkerLogsRequest(job_id=job_id, attempt=attempt, tail_lines=tail_lines)
        reply = await _call(f"node agent at {address}",
                            self._stub(address).GetWorkerLogs(request, timeout=self._timeout))
        return [convert.log_line_from_pb(line) for line in reply.lines]

    async def set_gpu_health(self, address: str, *, gpu_index: int, healthy: bool, operator: str,
                             reason: str) -> None:
        request = agent_pb2.SetGpuHealthRequest(gpu_index=gpu_index, healthy=healthy, operator=operator,
                                                reason=reason)
        await _call(f"node agent at {address}", self._stub(address).SetGpuHealth(request, timeout=self._timeout))

    async def close(self) -> None:
        channels, self._channels, self._stubs = list(self._channels.values()), {}, {}
        for channel in channels:
            await channel.close()
