"""The gateway's grpc.aio client of the checkpoint-store, and the one mapping of its messages to API models.

Every call names the team it acts for in the `x-trainyard-team` metadata: the checkpoint-store's job binding
(trainyard_checkpoint/access.py) admits the gateway's certificate only to the jobs recorded for that team, and
answers NOT_FOUND for any other, as if absent. The gateway names the team of the job the route is on, which it
has just read from the scheduler under the caller's role (an operator acts on any team's job, so it names
that job's team, not its own). Whether a checkpoint belongs to the job in the path is the router's check: the
store binds a checkpoint id to its team, not to a job a caller names.

A refusal of the gateway itself (PERMISSION_DENIED, UNAUTHENTICATED: a certificate the store does not admit)
is a deployment fault, not the caller's: it becomes Unavailable (503) naming the store, never a 401 or 403 that
would blame the caller's token. The channel comes from the gateway's `Channels` pool at each call, expecting
the `trainyard://checkpoint-store` principal.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

import grpc
import grpc.aio
from google.protobuf.timestamp_pb2 import Timestamp

from trainyard.checkpoint.v1 import checkpoint_pb2 as pb
from trainyard.checkpoint.v1 import checkpoint_pb2_grpc as pb_grpc
from trainyard_core.errors import NotFound, PermissionDenied, TrainyardError, Unauthenticated, Unavailable
from trainyard_core.rpc.errors import from_rpc_error

from .schemas import checkpoints as cs

T = TypeVar("T")
# trainyard_checkpoint.access.TEAM_HEADER (the gateway does not import the checkpoint-store's package).
TEAM_METADATA = "x-trainyard-team"
WHAT = "checkpoint-store"


async def _call(call: Awaitable[T]) -> T:
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        error: TrainyardError = from_rpc_error(exc, WHAT)
        if isinstance(error, PermissionDenied | Unauthenticated):
            raise Unavailable(f"the {WHAT} refused the gateway ({error.message}); this is the deployment's "
                              "fault, not the request's: an operator must check the gateway's certificate and "
                              "the checkpoint-store's settings") from exc
        raise error from exc


# --- conversion ------------------------------------------------------------------------------------------------

_STATES = frozenset(cs.CHECKPOINT_STATE_NAMES)


def state_name(value: int) -> str:
    item = pb.CheckpointState.DESCRIPTOR.values_by_number.get(value)
    short = item.name.removeprefix("CHECKPOINT_STATE_").lower() if item is not None else ""
    return short if short in _STATES else "unknown"


def _time(ts: Timestamp) -> datetime | None:
    if ts.seconds == 0 and ts.nanos == 0:
        return None
    return ts.ToDatetime(tzinfo=UTC)


def _job_spec(text: str) -> dict[str, Any] | None:
    if not text:
        return None
    try:
        spec = json.loads(text)
    except ValueError:  # the store checks it is a JSON object at Begin; an old record may not be
        return None
    return spec if isinstance(spec, dict) else None


def checkpoint_from_pb(ckpt: pb.Checkpoint, *, team: str, latest_id: str, with_spec: bool) -> cs.JobCheckpoint:
    lineage = ckpt.lineage
    return cs.JobCheckpoint(
        id=ckpt.id, job_id=ckpt.job_id, team=team, attempt=ckpt.attempt, step=ckpt.step, world_size=ckpt.world_size,
        state=state_name(ckpt.state), latest=bool(latest_id) and ckpt.id == latest_id, tags=list(ckpt.tags),
        size_bytes=ckpt.total_bytes, shard_count=len(ckpt.shards), location=ckpt.location,
        metadata=dict(ckpt.metadata),
        lineage=cs.CheckpointLineage(code_version=lineage.code_version, parameters=dict(lineage.parameters),
                                     job_spec=_job_spec(lineage.job_spec) if with_spec else None),
        created_at=_time(ckpt.created_at), committed_at=_time(ckpt.committed_at),
        aborted_at=_time(ckpt.aborted_at), abort_reason=ckpt.abort_reason, damaged_at=_time(ckpt.damaged_at),
        damage=ckpt.damage, deleted_at=_time(ckpt.deleted_at))


def manifest_from_pb(ckpt: pb.Checkpoint) -> cs.CheckpointManifest:
    return cs.CheckpointManifest(
        checkpoint_id=ckpt.id, job_id=ckpt.job_id, step=ckpt.step, world_size=ckpt.world_size,
        state=state_name(ckpt.state), location=ckpt.location, manifest_file=ckpt.manifest_path,
        size_bytes=ckpt.total_bytes,
        shards=[cs.ShardFile(path=s.path, rank=s.rank, size_bytes=s.size_bytes, checksum=s.checksum)
                for s in ckpt.shards])


# --- the client ------------------------------------------------------------------------------------------------

class CheckpointStoreClient:
    """CheckpointService calls on one job's checkpoints, for `team` (the job's). Records come back as the store's
    messages (`get`, for the router's checks) or as API models with the job's latest pointer applied."""

    def __init__(self, channel: Callable[[], grpc.aio.Channel], *, timeout_s: float) -> None:
        self._channel = channel
        self._timeout = timeout_s
        self._stub: pb_grpc.CheckpointServiceStub | None = None
        self._stub_channel: grpc.aio.Channel | None = None

    @property
    def _ckpt(self) -> pb_grpc.CheckpointServiceStub:
        channel = self._channel()  # the pool may have replaced it (a rotated certificate)
        if self._stub is None or channel is not self._stub_channel:
            self._stub, self._stub_channel = pb_grpc.CheckpointServiceStub(channel), channel
        return self._stub

    def _options(self, team: str) -> dict[str, Any]:
        return {"timeout": self._timeout, "metadata": ((TEAM_METADATA, team),)}

    async def latest_id(self, job_id: str, *, team: str) -> str:
        """The id of the job's latest committed checkpoint; '' when it has none."""
        try:
            reply = await _call(self._ckpt.GetLatestCheckpoint(pb.GetLatestCheckpointRequest(job_id=job_id),
                                                               **self._options(team)))
        except NotFound:
            return ""
        return str(reply.checkpoint.id)

    async def list(self, job_id: str, *, team: str, page_size: int, page_token: str) -> cs.CheckpointList:
        """One page of the job's checkpoints in creation order. A job whose workers never reached the store with
        a credential has no team recorded there, and so nothing the gateway may see: an empty page."""
        request = pb.ListCheckpointsRequest(job_id=job_id, page_size=page_size, page_token=page_token)
        try:
            reply = await _call(self._ckpt.ListCheckpoints(request, **self._options(team)))
        except NotFound:
            return cs.CheckpointList(checkpoints=[], next_page_token="")
        latest = await self.latest_id(job_id, team=team) if reply.checkpoints else ""
        return cs.CheckpointList(checkpoints=[checkpoint_from_pb(c, team=team, latest_id=latest, with_spec=False)
                                              for c in reply.checkpoints], next_page_token=reply.next_page_token)

    async def get(self, checkpoint_id: str, *, team: str) -> pb.Checkpoint:
        reply = await _call(self._ckpt.GetCheckpoint(pb.GetCheckpointRequest(checkpoint_id=checkpoint_id),
                                                     **self._options(team)))
        ckpt: pb.Checkpoint = reply.checkpoint
        return ckpt

    async def shown(self, ckpt: pb.Checkpoint, *, team: str, with_spec: bool = True) -> cs.JobCheckpoint:
        """`ckpt` as the API shows it: with whether it is the job's latest."""
        latest = await self.latest_id(ckpt.job_id, team=team)
        return checkpoint_from_pb(ckpt, team=team, latest_id=latest, with_spec=with_spec)

    async def tag(self, checkpoint_id: str, tag: str, *, team: str) -> pb.Checkpoint:
        reply = await _call(self._ckpt.TagCheckpoint(pb.TagCheckpointRequest(checkpoint_id=checkpoint_id, tag=tag),
                                                     **self._options(team)))
        ckpt: pb.Checkpoint = reply.checkpoint
        return ckpt

    async def untag(self, checkpoint_id: str, tag: str, *, team: str) -> pb.Checkpoint:
        request = pb.UntagCheckpointRequest(checkpoint_id=checkpoint_id, tag=tag)
        reply = await _call(self._ckpt.UntagCheckpoint(request, **self._options(team)))
        ckpt: pb.Checkpoint = reply.checkpoint
        return ckpt

    async def delete(self, checkpoint_id: str, *, team: str) -> pb.Checkpoint:
        """Delete, then the record as it is now (DELETED: a tombstone the store keeps for a while)."""
        await _call(self._ckpt.DeleteCheckpoint(pb.DeleteCheckpointRequest(checkpoint_id=checkpoint_id),
                                                **self._options(team)))
        return await self.get(checkpoint_id, team=team)
