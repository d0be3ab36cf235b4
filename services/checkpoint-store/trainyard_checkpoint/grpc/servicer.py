"""CheckpointService over gRPC: each method converts the request, calls the manager, converts the answer.

Domain errors propagate to the shared ErrorMappingInterceptor, which turns them into status codes
(INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION, ABORTED, UNAVAILABLE) with their messages.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import grpc.aio

from trainyard.checkpoint.v1 import checkpoint_pb2 as pb
from trainyard.checkpoint.v1 import checkpoint_pb2_grpc as pb_grpc

from ..gc import GarbageCollector
from ..leases import RestoreLeases
from ..manager import CheckpointManager
from . import convert

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["CheckpointService"].full_name

Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]


class CheckpointServicer(pb_grpc.CheckpointServiceServicer):
    def __init__(self, manager: CheckpointManager, leases: RestoreLeases, gc: GarbageCollector) -> None:
        self._manager = manager
        self._leases = leases
        self._gc = gc

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

    async def ReportDamaged(self, request: pb.ReportDamagedRequest, context: Context) -> pb.ReportDamagedResponse:
        report = await self._manager.report_damaged(request.checkpoint_id, list(request.shard_paths),
                                                    request.reason)
        return pb.ReportDamagedResponse(checkpoint=convert.checkpoint_to_pb(report.checkpoint),
                                        latest_checkpoint_id=report.latest_id or "")

    async def TagCheckpoint(self, request: pb.TagCheckpointRequest, context: Context) -> pb.TagCheckpointResponse:
        ckpt = await self._manager.tag(request.checkpoint_id, request.tag)
        return pb.TagCheckpointResponse(checkpoint=convert.checkpoint_to_pb(ckpt))

    async def UntagCheckpoint(self, request: pb.UntagCheckpointRequest,
                              context: Context) -> pb.UntagCheckpointResponse:
        ckpt = await self._manager.untag(request.checkpoint_id, request.tag)
        return pb.UntagCheckpointResponse(checkpoint=convert.checkpoint_to_pb(ckpt))

    async def SetRetention(self, request: pb.SetRetentionRequest, context: Context) -> pb.SetRetentionResponse:
        policy = convert.policy(request.policy) if request.HasField("policy") else None
        stored = await self._manager.set_retention(request.job_id, policy)
        return pb.SetRetentionResponse(policy=convert.policy_to_pb(stored) if stored is not None else None)

    async def GetRetention(self, request: pb.GetRetentionRequest, context: Context) -> pb.GetRetentionResponse:
        policy = await self._manager.retention(request.job_id)
        return pb.GetRetentionResponse(policy=convert.policy_to_pb(policy) if policy is not None else None)

    async def AcquireRestoreLease(self, request: pb.AcquireRestoreLeaseRequest,
                                  context: Context) -> pb.AcquireRestoreLeaseResponse:
        lease = await self._leases.acquire(request.checkpoint_id, request.ttl_s, request.holder)
        return pb.AcquireRestoreLeaseResponse(lease_id=lease.lease_id, ttl_s=lease.ttl_s,
                                              checkpoint=convert.checkpoint_to_pb(lease.checkpoint))

    async def RenewRestoreLease(self, request: pb.RenewRestoreLeaseRequest,
                                context: Context) -> pb.RenewRestoreLeaseResponse:
        ttl = await self._leases.renew(request.checkpoint_id, request.lease_id)
        return pb.RenewRestoreLeaseResponse(ttl_s=ttl)

    async def ReleaseRestoreLease(self, request: pb.ReleaseRestoreLeaseRequest,
                                  context: Context) -> pb.ReleaseRestoreLeaseResponse:
        await self._leases.release(request.checkpoint_id, request.lease_id)
        return pb.ReleaseRestoreLeaseResponse()

    async def RunGc(self, request: pb.RunGcRequest, context: Context) -> pb.RunGcResponse:
        actions = await self._gc.run_once(dry_run=request.dry_run)
        return pb.RunGcResponse(actions=[convert.gc_action_to_pb(a) for a in actions], dry_run=request.dry_run)
