"""A real gRPC server implementing the scheduler's NodeService for the agent's tests: it records every call
and can be told to answer `reregister`, to fail exit reports for a while, or to refuse registration."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import grpc.aio

from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc


class RecordingNodeService(scheduler_pb2_grpc.NodeServiceServicer):
    def __init__(self, *, interval_ms: int = 200, epoch: int = 1) -> None:
        self.interval_ms = interval_ms
        self.epoch = epoch
        self.registers: list[scheduler_pb2.RegisterNodeRequest] = []
        self.heartbeats: list[scheduler_pb2.HeartbeatRequest] = []
        self.exits: list[scheduler_pb2.ReportWorkerExitRequest] = []
        self.exit_attempts = 0
        self.reregister_once = False
        self.fail_exits = 0
        self.refuse = ""

    async def RegisterNode(self, request: scheduler_pb2.RegisterNodeRequest,
                           context: grpc.aio.ServicerContext) -> scheduler_pb2.RegisterNodeResponse:
        if self.refuse:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.refuse)
        self.registers.append(request)
        return scheduler_pb2.RegisterNodeResponse(node_id=request.node.node_id,
                                                  heartbeat_interval_ms=self.interval_ms, leader_epoch=self.epoch)

    async def Heartbeat(self, request_iterator: AsyncIterator[scheduler_pb2.HeartbeatRequest],
                        context: grpc.aio.ServicerContext) -> AsyncIterator[scheduler_pb2.HeartbeatResponse]:
        async for beat in request_iterator:
            self.heartbeats.append(beat)
            reregister, self.reregister_once = self.reregister_once, False
            yield scheduler_pb2.HeartbeatResponse(ack_seq=beat.seq, leader_epoch=self.epoch, reregister=reregister)

    async def ReportWorkerExit(self, request: scheduler_pb2.ReportWorkerExitRequest,
                               context: grpc.aio.ServicerContext) -> scheduler_pb2.ReportWorkerExitResponse:
        self.exit_attempts += 1
        if self.fail_exits > 0:
            self.fail_exits -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler is busy")
        self.exits.append(request)
        return scheduler_pb2.ReportWorkerExitResponse()

    def gpu_health_seen(self, index: int) -> types_pb2.GpuHealth.ValueType | None:
        """Health of GPU `index` in the latest heartbeat that mentions it."""
        for beat in reversed(self.heartbeats):
            for gpu in beat.gpus:
                if gpu.index == index:
                    return gpu.health
        return None


async def serve(service: RecordingNodeService, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_NodeServiceServicer_to_server(service, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    assert bound, f"cannot listen on port {port}"
    await server.start()
    return server, bound
