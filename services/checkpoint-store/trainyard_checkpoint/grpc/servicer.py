"""CheckpointService over gRPC: each method converts the request, calls the manager, converts the answer.

Domain errors propagate to the shared ErrorMappingInterceptor, which turns them into status codes
(INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION, ABORTED, UNAVAILABLE) with their messages.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import grpc.aio

from trainyard.checkpoint.v1 import checkpoint_pb2 as pb
from trainyard.checkpoint.v1 import checkpoint_pb2_grpc as pb_grpc

from ..manager import CheckpointManager
from . import convert

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["CheckpointService"].full_name

Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]


class CheckpointServicer(pb_grpc.CheckpointServiceServicer):
    def __init__(self, manager: CheckpointManager) -> None:
        self._manager = manager

    async def BeginCheckpoint(self, request: pb.BeginCheckpointRequest,
                              context: Context) -> pb.BeginCheckpointResponse:
        ckpt = await self._manager.begin(convert.begin_request(request))
        return pb.BeginCheckpointResponse(checkpoint=convert.checkpoint_to_pb(ckpt))

    async def CommitCheckpoint(self, request: pb.CommitCheckpointRequest,
                               context: Context) -> pb.CommitCheckpointResponse:
        ckpt = await self._manager.commit(request.checkpoint_id, convert.shards(request.shards))
        return pb.CommitCheckpointResponse(checkpoint=convert.checkpoint_to_pb(ckpt))

    async def AbortCheckpoint(self, request: pb.AbortCheckpointRequest,
                              context: Context) -> pb.AbortCheckpointResponse:
        ckpt = await self._manager.abort(request.checkpoint_id, request.reason)
        return pb.AbortCheckpointResponse(checkpoint=convert.checkpoint_to_pb(ckpt))

    async def GetCheckpoint(self, request: pb.GetCheckpointRequest,
                            context: Context) -> pb.GetCheckpointResponse:
        ckpt = await self._manager.get(request.checkpoint_id)
        return pb.GetCheckpointResponse(checkpoint=convert.checkpoint_to_pb(ckpt))

    async def ListCheckpoints(self, request: pb.ListCheckpointsRequest,
                              context: Context) -> pb.ListCheckpointsResponse:
        page = await self._manager.list(request.job_id, request.page_size, request.page_token)
        return pb.ListCheckpointsResponse(checkpoints=[convert.checkpoint_to_pb(c) for c in page.checkpoints],
                                          next_page_token=page.next_page_token)

    async def GetLatestCheckpoint(self, request: pb.GetLatestCheckpointRequest,
                                  context: Context) -> pb.GetLatestCheckpointResponse:
        ckpt = await self._manager.latest(request.job_id)
        return pb.GetLatestCheckpointResponse(checkpoint=convert.checkpoint_to_pb(ckpt))

    async def DeleteCheckpoint(self, request: pb.DeleteCheckpointRequest,
                               context: Context) -> pb.DeleteCheckpointResponse:
        await self._manager.delete(request.checkpoint_id)
        return pb.DeleteCheckpointResponse()
