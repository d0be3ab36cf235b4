"""The streaming calls of the gateway's clients: the scheduler's WatchJob and the agents' StreamWorkerLogs
(and ListWorkers, which tells a log stream that ended because its workers ended from one that ended before
they started); and the agents' GetWorkerLogs with its selection by time (`read_worker_logs`).

Each is an async generator over API values (conversion in `convert`). A failed call raises the domain error
it stands for, like the unary calls of `clients`. Closing the generator (the caller stops: its HTTP client
went away) cancels the RPC at once, so no stream is left open on the scheduler or an agent. Streams have
no deadline: they last as long as their caller wants them; HTTP/2 keepalive of the channel pool ends one
whose peer died.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc
import grpc.aio

from trainyard.agent.v1 import agent_pb2
from trainyard.scheduler.v1 import scheduler_pb2
from trainyard_core.rpc.errors import from_rpc_error

from . import convert
from .clients import AgentClients, SchedulerClient
from .schemas.jobs import Job
from .schemas.logs import LogLine


async def _replies(what: str, call: Any) -> AsyncIterator[Any]:
    try:
        async for reply in call:
            yield reply
    except grpc.aio.AioRpcError as exc:
        raise from_rpc_error(exc, what) from exc
    finally:
        call.cancel()  # a no-op once the call ended; otherwise the peer's handler is cancelled now


async def watch_job(scheduler: SchedulerClient, job_id: str, *, team: str) -> AsyncIterator[Job]:
    """The job now, then each change, until it is terminal (or was archived: the stream then just ends)."""
    call = scheduler.jobs_stub.WatchJob(scheduler_pb2.WatchJobRequest(job_id=job_id, team=team))
    async for reply in _replies("scheduler", call):
        yield convert.job_from_pb(reply.job)


def logs_request(*, job_id: str, attempt: int, tail_lines: int = 0, since_ms: int = 0,
                 after_seq: Mapping[int, int] | None = None) -> agent_pb2.GetWorkerLogsRequest:
    return agent_pb2.GetWorkerLogsRequest(job_id=job_id, attempt=attempt, tail_lines=tail_lines,
                                          since_unix_ms=since_ms, after_seq=dict(after_seq or {}))


async def read_worker_logs(agents: AgentClients, address: str, *, node_id: str, timeout_s: float,
                           request: agent_pb2.GetWorkerLogsRequest) -> list[LogLine]:
    """The lines `request` selects of the job on the node (GetWorkerLogs). NotFound: no workers of it there."""
    call = agents.stub(address, node_id).GetWorkerLogs(request, timeout=timeout_s)
    try:
        reply = await call
    except grpc.aio.AioRpcError as exc:
        raise from_rpc_error(exc, f"node agent of {node_id} at {address}") from exc
    return [convert.log_line_from_pb(line) for line in reply.lines]


async def stream_worker_logs(agents: AgentClients, address: str, *,
                             node_id: str, request: agent_pb2.GetWorkerLogsRequest) -> AsyncIterator[list[LogLine]]:
    """The retained lines `request` selects (its attempt; 0: every attempt), then the new ones, until no worker
    of it runs on the node. NotFound (at the first step) when the node has no workers of it."""
    call = agents.stub(address, node_id).StreamWorkerLogs(request)
    async for chunk in _replies(f"node agent of {node_id} at {address}", call):
        yield [convert.log_line_from_pb(line) for line in chunk.lines]


async def workers_known(agents: AgentClients, address: str, *, node_id: str, job_id: str, attempt: int,
                        timeout_s: float) -> tuple[bool, bool]:
    """(whether the agent knows workers of the job's attempt, whether any of them still runs)."""
    call = agents.stub(address, node_id).ListWorkers(agent_pb2.ListWorkersRequest(), timeout=timeout_s)
    try:
        reply = await call
    except grpc.aio.AioRpcError as exc:
        raise from_rpc_error(exc, f"node agent of {node_id} at {address}") from exc
    mine = [w for w in reply.workers if w.job_id == job_id and w.attempt == attempt]
    return bool(mine), any(w.running for w in mine)
