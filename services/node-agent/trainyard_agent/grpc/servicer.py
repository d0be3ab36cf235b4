"""AgentService: translates requests and answers, nothing else. Domain errors raised below become status
codes in trainyard_core's interceptor (INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION, ...)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc.aio

from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard_core.logs import log_context

from ..gpu_history import GpuHistory
from ..health.faults import FaultInjector
from ..health.operator import HealthOverrides
from ..workers.model import LogLine
from ..workers.supervisor import Supervisor
from . import convert

# A LogChunk holds at most this many lines, so a burst of output streams as several messages.
CHUNK_LINES = 2000

SERVICE_NAME = agent_pb2.DESCRIPTOR.services_by_name["AgentService"].full_name


class AgentServicer(agent_pb2_grpc.AgentServiceServicer):
    def __init__(self, supervisor: Supervisor, faults: FaultInjector, overrides: HealthOverrides,
                 history: GpuHistory) -> None:
        self._supervisor = supervisor
        self._faults = faults
        self._overrides = overrides
        self._history = history

    async def LaunchWorkers(self, request: agent_pb2.LaunchWorkersRequest,
                            context: grpc.aio.ServicerContext) -> agent_pb2.LaunchWorkersResponse:
        result = await self._supervisor.launch(convert.launch_from_pb(request))
        return convert.launch_result_to_pb(result)

    async def StopWorkers(self, request: agent_pb2.StopWorkersRequest,
                          context: grpc.aio.ServicerContext) -> agent_pb2.StopWorkersResponse:
        with log_context(job_id=request.job_id, reason=request.reason):
            if request.leader_epoch:
                # A deposed leader must not stop workers its successor placed; 0 is an unfenced operator call.
                self._supervisor.fence.check(request.leader_epoch)
            stopped = await self._supervisor.stop(request.job_id, request.attempt,
                                                  convert.grace_from_pb(request.grace_period_ms),
                                                  convert.stop_signal_from_pb(request.signal))
        return agent_pb2.StopWorkersResponse(stopped=stopped)

    async def RenewJobCredential(self, request: agent_pb2.RenewJobCredentialRequest,
                                 context: grpc.aio.ServicerContext) -> agent_pb2.RenewJobCredentialResponse:
        with log_context(job_id=request.job_id, attempt=request.attempt):
            workers = await self._supervisor.renew_credential(request.job_id, request.attempt, request.leader_epoch,
                                                              convert.credential_from_pb(request))
        return agent_pb2.RenewJobCredentialResponse(workers=workers)

    async def ListWorkers(self, request: agent_pb2.ListWorkersRequest,
                          context: grpc.aio.ServicerContext) -> agent_pb2.ListWorkersResponse:
        return agent_pb2.ListWorkersResponse(
            workers=[convert.worker_status_to_pb(s) for s in self._supervisor.list_workers()])

    async def GetWorkerLogs(self, request: agent_pb2.GetWorkerLogsRequest,
                            context: grpc.aio.ServicerContext) -> agent_pb2.GetWorkerLogsResponse:
        lines = await self._supervisor.read_logs(convert.log_query_from_pb(request))
        return agent_pb2.GetWorkerLogsResponse(lines=convert.log_lines_to_pb(lines))

    async def StreamWorkerLogs(self, request: agent_pb2.GetWorkerLogsRequest,
                               context: grpc.aio.ServicerContext) -> AsyncIterator[agent_pb2.LogChunk]:
        async for lines in self._supervisor.follow_logs(convert.log_query_from_pb(request)):
            for chunk in _chunks(lines):
                yield agent_pb2.LogChunk(lines=convert.log_lines_to_pb(chunk))

    async def InjectFault(self, request: agent_pb2.InjectFaultRequest,
                          context: grpc.aio.ServicerContext) -> agent_pb2.InjectFaultResponse:
        gpu = await self._faults.inject(request.gpu_index, request.kind, xid=request.xid, count=request.count,
                                        temperature_c=request.temperature_c)
        return agent_pb2.InjectFaultResponse(gpu=convert.gpu_to_pb(gpu))

    async def SetGpuHealth(self, request: agent_pb2.SetGpuHealthRequest,
                           context: grpc.aio.ServicerContext) -> agent_pb2.SetGpuHealthResponse:
        gpu = self._overrides.set_health(request.gpu_index, healthy=request.healthy, operator=request.operator,
                                         reason=request.reason)
        return agent_pb2.SetGpuHealthResponse(gpu=convert.gpu_to_pb(gpu))

    async def GetGpuMetrics(self, request: agent_pb2.GetGpuMetricsRequest,
                            context: grpc.aio.ServicerContext) -> agent_pb2.GetGpuMetricsResponse:
        return convert.gpu_history_to_pb(self._history.window(request.window_s, request.max_points))


def _chunks(lines: list[LogLine]) -> list[list[LogLine]]:
    return [lines[i:i + CHUNK_LINES] for i in range(0, len(lines), CHUNK_LINES)]
