"""grpc.aio clients of the scheduler (jobs, nodes, queues and quotas) and of the node agents (logs).

They take and return API models (conversion in `convert`), so routers never see protobuf. Every failed
call is turned into the domain error it stands for (`from_rpc_error`), which the gateway's one error
handler maps to an HTTP status. Channels come from a `Channels` pool owned by whoever built the clients
(GatewayApp), which closes it. The clients ask the pool for their channel at each call (a dictionary
look-up), so a rotated certificate is taken up by the next call, and each names the principal it must
reach: the scheduler, or the agent of the one node the call is meant for (mTLS refuses any other).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from datetime import datetime
from typing import Generic, TypeVar, cast

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard.scheduler.v1 import (
    audit_pb2_grpc,
    policy_pb2,
    policy_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    usage_pb2_grpc,
)
from trainyard_core import telemetry
from trainyard_core.audit import CARRIED_HEADER, FORWARDED_ENTRY_HEADER, AuditFilter, AuditPage, current_request_id
from trainyard_core.errors import FailedPrecondition, Unavailable
from trainyard_core.rpc.channels import Channels
from trainyard_core.rpc.errors import from_rpc_error, from_status, status_code
from trainyard_core.security import identity
from trainyard_core.security.identity import InvalidPrincipal, Principal

from . import audit_http, convert
from .schemas.jobs import Job, JobList, JobQuery, JobSubmit
from .schemas.nodes import Node
from .schemas.pending import PendingList
from .schemas.queues import Queue, QueuePut
from .schemas.quotas import Quota, QuotaPut
from .schemas.usage import UsageReport
from .submit_batcher import SubmitBatcher

T = TypeVar("T")
S = TypeVar("S")
W = TypeVar("W", scheduler_pb2.SubmitJobResponse, scheduler_pb2.CancelJobResponse, scheduler_pb2.HoldJobResponse,
            scheduler_pb2.ReleaseJobResponse, scheduler_pb2.SetJobPriorityResponse, scheduler_pb2.RequeueJobResponse)
LEADER_METADATA = "trainyard-leader"
# The etcd revision of the last job write the scheduler answered in this request (0: none): the routes send it
# back as X-Trainyard-Revision. Set by the client's call, read by the route that awaited it (one context).
WRITE_REVISION: ContextVar[int] = ContextVar("write_revision", default=0)
# A scheduler that answered this recently and cannot be connected to now is restarting (SchedulerClient._scheduler).
RECENT_S = 60.0
RECONNECT_WAIT_S = 3.0
# After a scheduler answered that it has no SubmitJobs (an older version, during an upgrade), submits go one by
# one for this long before a batch is tried again.
BATCH_RETRY_S = 60.0


class BatchesUnsupported(Exception):
    """The scheduler has no SubmitJobs (UNIMPLEMENTED): nothing was done."""


async def _call(what: str, call: Awaitable[T]) -> T:
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        raise from_rpc_error(exc, what) from exc


class _Stubs(Generic[S]):
    """The stub(s) of one channel, made again when the pool hands out another channel (after a certificate
    rotation) for the same peer."""

    def __init__(self, make: Callable[[grpc.aio.Channel], S]) -> None:
        self._make = make
        self._channel: grpc.aio.Channel | None = None
        self._stub: S | None = None

    def on(self, channel: grpc.aio.Channel) -> S:
        if self._stub is None or channel is not self._channel:
            self._channel, self._stub = channel, self._make(channel)
        return self._stub


class _SchedulerStubs:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.jobs = scheduler_pb2_grpc.JobServiceStub(channel)
        self.nodes = scheduler_pb2_grpc.NodeServiceStub(channel)
        self.policy = policy_pb2_grpc.PolicyServiceStub(channel)
        self.usage = usage_pb2_grpc.UsageServiceStub(channel)
        self.audit = audit_pb2_grpc.AuditServiceStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)


# A call that must reach the leader, given the stubs of a replica and the seconds left of its deadline.
LeaderCall = Callable[[_SchedulerStubs, float], Awaitable[T]]


class SchedulerClient:
    """JobService, NodeService and PolicyService of the scheduler. `team` empty means: every team (admin
    callers)."""

    def __init__(self, channel: Callable[[], grpc.aio.Channel], *, timeout_s: float,
                 leader_channel: Callable[[str], grpc.aio.Channel] | None = None,
                 replicas: Sequence[str] = (), submit_batch_max: int = 1, submit_calls: int = 1) -> None:
        # The channel to the configured replicas, asked for at each call (the pool may have replaced it).
        self._channel = channel
        self._main: _Stubs[_SchedulerStubs] = _Stubs(_SchedulerStubs)
        self._timeout = timeout_s
        # Channels to one replica by address (cached by their owner); without it, only `channel` is used.
        self._leader_channel = leader_channel
        # Every configured replica, asked in turn when a refusal does not say who leads.
        self._replicas = list(replicas) if leader_channel is not None else []
        self._stubs: dict[str, _Stubs[_SchedulerStubs]] = {}
        # The leader's address, once a replica named it and it answered; '': use the main channel.
        self._leader = ""
        # Told the etcd revision of every job write the scheduler answered (the read view's floor: job_view.py).
        self.on_write: Callable[[int], None] | None = None
        self._answered_at = -RECENT_S  # when the main channel last answered (monotonic)
        # Concurrent submits go together (submit_batcher.py); with a batch of 1, each is its own SubmitJob call.
        self._batcher = (SubmitBatcher(self._submit_jobs, max_items=submit_batch_max, max_calls=submit_calls,
                                       timeout_s=timeout_s) if submit_batch_max > 1 else None)
        self._batches_refused_at = -BATCH_RETRY_S  # when a scheduler last answered SubmitJobs UNIMPLEMENTED

    async def close(self) -> None:
        """Ends the submit calls in flight (the gateway is stopping)."""
        if self._batcher is not None:
            await self._batcher.close()

    async def _scheduler(self, make: Callable[[], Awaitable[T]]) -> T:
        """One call on the main channel. A scheduler that answered within RECENT_S and now cannot be connected
        to is restarting or failing over: the call is made once more when the channel connects again, within
        RECONNECT_WAIT_S. Only for a call that never left (gRPC's "failed to connect": the channel had no
        connection), so a write is never sent twice. A scheduler never reached fails at once, as before."""
        try:
            result = await make()
        except grpc.aio.AioRpcError as exc:
            if (exc.code() != grpc.StatusCode.UNAVAILABLE or "failed to connect" not in (exc.details() or "")
                    or time.monotonic() - self._answered_at > RECENT_S):
                raise from_rpc_error(exc, "scheduler") from exc
            try:
                await asyncio.wait_for(self._channel().channel_ready(), RECONNECT_WAIT_S)
            except TimeoutError:
                raise from_rpc_error(exc, "scheduler") from exc
            result = await _call("scheduler", make())
        self._answered_at = time.monotonic()
        return result

    def _written(self, reply: W) -> W:
        """A job write's answer, passed through: its revision noted (WRITE_REVISION, `on_write`)."""
        revision = int(reply.revision)
        if revision:
            WRITE_REVISION.set(revision)
            if self.on_write is not None:
                self.on_write(revision)
        return reply

    @property
    def _jobs(self) -> scheduler_pb2_grpc.JobServiceStub:
        return self._main.on(self._channel()).jobs

    @property
    def jobs_stub(self) -> scheduler_pb2_grpc.JobServiceStub:
        """For the streaming calls (clients_streams): any replica answers them, on the main channel."""
        return self._jobs

    @property
    def _policy(self) -> policy_pb2_grpc.PolicyServiceStub:
        return self._main.on(self._channel()).policy

    @property
    def _usage(self) -> usage_pb2_grpc.UsageServiceStub:
        return self._main.on(self._channel()).usage

    @property
    def _audit(self) -> audit_pb2_grpc.AuditServiceStub:
        return self._main.on(self._channel()).audit

    @property
    def _health(self) -> health_pb2_grpc.HealthStub:
        return self._main.on(self._channel()).health

    def _stub(self, address: str) -> _SchedulerStubs:
        assert self._leader_channel is not None
        stubs = self._stubs.get(address)
        if stubs is None:
            stubs = self._stubs[address] = _Stubs(_SchedulerStubs)
        return stubs.on(self._leader_channel(address))

    async def _on_leader(self, call: LeaderCall[T]) -> T:
        """NodeService calls and ListPending must reach the leader (only it hears the agents' heartbeats and
        orders the queue). Any replica answers the other job calls, so the main channel may be on a standby, and
        a standby refuses leader calls with UNAVAILABLE, naming the leader when it knows it (`trainyard-leader`
        metadata).

        Asked in order, each at most once, all within one call's deadline: the leader remembered from an
        earlier call, the main channel, then whoever a refusal names, and — when a refusal names nobody (a
        replica that does not know yet, or one that is down) — every configured replica in turn, so a
        leader that exists is found whatever the replica in front of it knows. Leader calls are reads and
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
                result = await call(self._main.on(self._channel()) if target is None else self._stub(target), left)
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

    async def submit_job(self, spec: JobSubmit, *, team: str, user: str,
                         idempotency_key: str = "") -> tuple[Job, bool]:
        """The job, and whether this call created it (False: an idempotency key answered with an earlier one)."""
        request = scheduler_pb2.SubmitJobRequest(spec=convert.spec_to_pb(spec), team=team, user=user,
                                                 idempotency_key=idempotency_key)
        # The HTTP request's audit entry, for the scheduler to store with the job (audit_http.Forwarding).
        forward = audit_http.forwarding.get()
        entry = forward.entry({"team": team, "name": spec.name, "user": user}) if forward is not None else None
        entry_json = entry.to_json().decode() if entry is not None else ""
        reply: scheduler_pb2.SubmitJobResponse | None = None
        if self._batcher is not None and time.monotonic() - self._batches_refused_at >= BATCH_RETRY_S:
            item = scheduler_pb2.SubmitJobsItem(request=request, request_id=current_request_id.get(),
                                                traceparent=telemetry.traceparent(),
                                                forwarded_audit_entry=entry_json)
            try:
                result = await self._batcher.submit(item)
            except BatchesUnsupported:
                self._batches_refused_at = time.monotonic()
            else:
                outcome = result.WhichOneof("outcome")
                if outcome == "error":
                    raise from_status(status_code(result.error.code), result.error.message, result.error.kind,
                                      "scheduler")
                if outcome != "submitted":
                    raise Unavailable("the scheduler answered a submit with neither a job nor an error; whether it "
                                      "was stored is unknown: list your jobs before submitting again")
                reply = result.submitted
                if forward is not None and entry is not None:
                    forward.carried = result.audit_carried
        if reply is None:
            reply = await self._submit_job(request, entry_json, forward if entry is not None else None)
        reply = self._written(reply)
        return convert.job_from_pb(reply.job), reply.created

    async def _submit_job(self, request: scheduler_pb2.SubmitJobRequest, entry_json: str,
                          forward: audit_http.Forwarding | None) -> scheduler_pb2.SubmitJobResponse:
        """One SubmitJob call (batching off, or a scheduler that has no SubmitJobs)."""
        metadata = ((FORWARDED_ENTRY_HEADER, entry_json),) if entry_json else ()

        async def submit() -> scheduler_pb2.SubmitJobResponse:
            call = self._jobs.SubmitJob(request, timeout=self._timeout, metadata=metadata)
            reply = await call
            if forward is not None:
                forward.carried = dict(await call.trailing_metadata() or ()).get(CARRIED_HEADER) == "1"
            return cast(scheduler_pb2.SubmitJobResponse, reply)

        return await self._scheduler(submit)

    async def _submit_jobs(self, request: scheduler_pb2.SubmitJobsRequest,
                           timeout: float) -> scheduler_pb2.SubmitJobsResponse:
        """One SubmitJobs call (the batcher's), with `timeout` (what is left of its oldest item's). A scheduler
        older than SubmitJobs answers UNIMPLEMENTED, having done nothing: BatchesUnsupported, and the submits
        are sent one by one (for BATCH_RETRY_S)."""
        async def submit() -> scheduler_pb2.SubmitJobsResponse:
            try:
                return cast(scheduler_pb2.SubmitJobsResponse,
                            await self._jobs.SubmitJobs(request, timeout=timeout))
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    raise BatchesUnsupported(exc.details() or "") from exc
                raise

        return await self._scheduler(submit)

    async def get_job(self, job_id: str, *, team: str) -> Job:
        request = scheduler_pb2.GetJobRequest(job_id=job_id, team=team)
        reply = await self._scheduler(lambda: self._jobs.GetJob(request, timeout=self._timeout))
        return convert.job_from_pb(reply.job)

    async def list_jobs(self, query: JobQuery, *, page_size: int, page_token: str) -> JobList:
        request = convert.job_query_to_pb(query, page_size=page_size, page_token=page_token)
        reply = await self._scheduler(lambda: self._jobs.ListJobs(request, timeout=self._timeout))
        return JobList(jobs=[convert.job_from_pb(j) for j in reply.jobs], next_page_token=reply.next_page_token)

    async def cancel_job(self, job_id: str, *, team: str, user: str, reason: str = "") -> Job:
        request = scheduler_pb2.CancelJobRequest(job_id=job_id, team=team, user=user, reason=reason)
        reply = self._written(await self._scheduler(lambda: self._jobs.CancelJob(request, timeout=self._timeout)))
        return convert.job_from_pb(reply.job)

    async def hold_job(self, job_id: str, *, team: str, user: str, reason: str = "") -> Job:
        request = scheduler_pb2.HoldJobRequest(job_id=job_id, team=team, user=user, reason=reason)
        reply = self._written(await self._scheduler(lambda: self._jobs.HoldJob(request, timeout=self._timeout)))
        return convert.job_from_pb(reply.job)

    async def release_job(self, job_id: str, *, team: str, user: str) -> Job:
        request = scheduler_pb2.ReleaseJobRequest(job_id=job_id, team=team, user=user)
        reply = self._written(await self._scheduler(lambda: self._jobs.ReleaseJob(request, timeout=self._timeout)))
        return convert.job_from_pb(reply.job)

    async def set_job_priority(self, job_id: str, *, team: str, user: str, priority: int) -> Job:
        request = scheduler_pb2.SetJobPriorityRequest(job_id=job_id, team=team, user=user, priority=priority)
        reply = self._written(await self._scheduler(lambda: self._jobs.SetJobPriority(request, timeout=self._timeout)))
        return convert.job_from_pb(reply.job)

    async def requeue_job(self, job_id: str, *, team: str, user: str, reason: str = "") -> Job:
        request = scheduler_pb2.RequeueJobRequest(job_id=job_id, team=team, user=user, reason=reason)
        reply = self._written(await self._scheduler(lambda: self._jobs.RequeueJob(request, timeout=self._timeout)))
        return convert.job_from_pb(reply.job)

    async def list_nodes(self) -> list[Node]:
        reply = await self._on_leader(lambda s, left: s.nodes.ListNodes(scheduler_pb2.ListNodesRequest(),
                                                                        timeout=left))
        return [convert.node_from_pb(n) for n in reply.nodes]

    async def get_node(self, node_id: str) -> Node:
        reply = await self._on_leader(lambda s, left: s.nodes.GetNode(scheduler_pb2.GetNodeRequest(node_id=node_id),
                                                                      timeout=left))
        return convert.node_from_pb(reply.node)

    async def cordon_node(self, node_id: str, *, cordoned: bool, reason: str) -> Node:
        request = scheduler_pb2.CordonNodeRequest(node_id=node_id, cordoned=cordoned, reason=reason)
        reply = await self._on_leader(lambda s, left: s.nodes.CordonNode(request, timeout=left))
        return convert.node_from_pb(reply.node)

    async def list_pending(self, *, team: str, queue: str, job_id: str, limit: int) -> PendingList:
        """The leader's queue order (only it has one)."""
        request = scheduler_pb2.ListPendingRequest(team=team, queue=queue, job_id=job_id, limit=limit)
        reply = await self._on_leader(lambda s, left: s.jobs.ListPending(request, timeout=left))
        return convert.pending_from_pb(reply)

    async def list_queues(self) -> list[Queue]:
        reply = await self._scheduler(lambda: self._policy.ListQueues(policy_pb2.ListQueuesRequest(),
                                                                 timeout=self._timeout))
        return [convert.queue_from_pb(q) for q in reply.queues]

    async def put_queue(self, name: str, body: QueuePut) -> tuple[Queue, bool]:
        request = policy_pb2.PutQueueRequest(queue=convert.queue_to_pb(name, body))
        reply = await self._scheduler(lambda: self._policy.PutQueue(request, timeout=self._timeout))
        return convert.queue_from_pb(reply.queue), reply.created

    async def delete_queue(self, name: str) -> Queue:
        reply = await self._scheduler(lambda: self._policy.DeleteQueue(policy_pb2.DeleteQueueRequest(name=name),
                                                                  timeout=self._timeout))
        return convert.queue_from_pb(reply.queue)

    async def list_quotas(self, *, team: str) -> list[Quota]:
        reply = await self._scheduler(lambda: self._policy.ListQuotas(policy_pb2.ListQuotasRequest(team=team),
                                                                 timeout=self._timeout))
        return [convert.quota_from_pb(q) for q in reply.quotas]

    async def get_quota(self, team: str) -> Quota:
        reply = await self._scheduler(lambda: self._policy.GetQuota(policy_pb2.GetQuotaRequest(team=team),
                                                               timeout=self._timeout))
        return convert.quota_from_pb(reply.quota)

    async def put_quota(self, team: str, body: QuotaPut) -> tuple[Quota, bool]:
        request = policy_pb2.PutQuotaRequest(quota=convert.quota_to_pb(team, body))
        reply = await self._scheduler(lambda: self._policy.PutQuota(request, timeout=self._timeout))
        return convert.quota_from_pb(reply.quota), reply.created

    async def delete_quota(self, team: str) -> Quota:
        reply = await self._scheduler(lambda: self._policy.DeleteQuota(policy_pb2.DeleteQuotaRequest(team=team),
                                                                  timeout=self._timeout))
        return convert.quota_from_pb(reply.quota)

    async def get_usage(self, *, since: datetime, until: datetime, group_by: str, team: str,
                        limit: int) -> UsageReport:
        """Any replica answers (from its mirror and the history store)."""
        request = convert.usage_request_to_pb(since=since, until=until, group_by=group_by, team=team, limit=limit)
        reply = await self._scheduler(lambda: self._usage.GetUsage(request, timeout=self._timeout))
        return convert.usage_from_pb(reply, since=since, until=until, team=team)

    async def list_audit(self, flt: AuditFilter, *, page_size: int, page_token: str) -> AuditPage:
        """Any replica answers (etcd's entries not moved yet, merged with the history store's)."""
        request = convert.audit_request_to_pb(flt, page_size=page_size, page_token=page_token)
        return convert.audit_page_from_pb(await self._scheduler(lambda: self._audit.ListAuditEntries(
            request, timeout=self._timeout)))

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
    """AgentService clients, one channel per (agent address, node), from the gateway's channel pool.

    Every call names the node it is meant for as well as its address: with mTLS the agent must present the
    certificate of that node (`trainyard://node/<node_id>`), so an address that a node record still holds
    after another node took it over is refused rather than asked for the wrong node's logs or GPUs."""

    def __init__(self, channels: Channels, *, timeout_s: float) -> None:
        self._channels = channels
        self._timeout = timeout_s
        self._stubs: dict[tuple[str, str], _Stubs[agent_pb2_grpc.AgentServiceAsyncStub]] = {}

    def _stub(self, address: str, node_id: str) -> agent_pb2_grpc.AgentServiceAsyncStub:
        try:
            expected: Principal = identity.node(node_id)
        except InvalidPrincipal as exc:
            raise FailedPrecondition(f"node {node_id!r}: its agent cannot be verified: {exc}") from exc
        stubs = self._stubs.get((address, node_id))
        if stubs is None:
            stubs = self._stubs[(address, node_id)] = _Stubs(
                lambda channel: cast("agent_pb2_grpc.AgentServiceAsyncStub", agent_pb2_grpc.AgentServiceStub(channel)))
        return stubs.on(self._channels.get(address, expected))

    def stub(self, address: str, node_id: str) -> agent_pb2_grpc.AgentServiceAsyncStub:
        """The stub for `node_id`'s agent at `address` (clients_streams' log streams)."""
        return self._stub(address, node_id)

    async def set_gpu_health(self, address: str, *, node_id: str, gpu_index: int, healthy: bool, operator: str,
                             reason: str) -> None:
        request = agent_pb2.SetGpuHealthRequest(gpu_index=gpu_index, healthy=healthy, operator=operator,
                                                reason=reason)
        await _call(f"node agent of {node_id} at {address}",
                    self._stub(address, node_id).SetGpuHealth(request, timeout=self._timeout))

    async def gpu_metrics(self, address: str, *, node_id: str, window_s: int, max_points: int,
                          timeout_s: float | None = None) -> agent_pb2.GetGpuMetricsResponse:
        """The node's GPU telemetry over the window and its GPUs' XID and health history (GetGpuMetrics)."""
        request = agent_pb2.GetGpuMetricsRequest(window_s=window_s, max_points=max_points)
        reply: agent_pb2.GetGpuMetricsResponse = await _call(
            f"node agent of {node_id} at {address}",
            self._stub(address, node_id).GetGpuMetrics(request, timeout=timeout_s or self._timeout))
        return reply

    def forget(self) -> None:
        """Drop the stubs (the channels are the pool's, closed by its owner)."""
        self._stubs.clear()
