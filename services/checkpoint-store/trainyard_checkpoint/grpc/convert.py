"""The one place where protobuf messages become domain values and back. No decisions here: validation
is the domain's (so an out-of-range proto value reaches it unchanged and is refused with a message)."""

from __future__ import annotations

from collections.abc import Sequence

from google.protobuf.timestamp_pb2 import Timestamp

from trainyard.checkpoint.v1 import checkpoint_pb2 as pb

from ..domain import Checkpoint, CheckpointState, Shard
from ..domain.validation import BeginRequest

_STATE_TO_PB: dict[CheckpointState, pb.CheckpointState.ValueType] = {
    CheckpointState.WRITING: pb.CHECKPOINT_STATE_WRITING,
    CheckpointState.COMMITTED: pb.CHECKPOINT_STATE_COMMITTED,
    CheckpointState.ABORTED: pb.CHECKPOINT_STATE_ABORTED,
    CheckpointState.DELETED: pb.CHECKPOINT_STATE_DELETED,
}


def _timestamp(seconds: float | None) -> Timestamp | None:
    if seconds is None:
        return None
    ts = Timestamp()
    ts.FromNanoseconds(round(seconds * 1e9))
    return ts


def begin_request(req: pb.BeginCheckpointRequest) -> BeginRequest:
    return BeginRequest(job_id=req.job_id, attempt=req.attempt, step=req.step, world_size=req.world_size,
                        metadata=dict(req.metadata))


def shards(items: Sequence[pb.ShardInfo]) -> list[Shard]:
    return [Shard(rank=s.rank, path=s.path, size_bytes=s.size_bytes, checksum=s.checksum) for s in items]


def shard_to_pb(shard: Shard) -> pb.ShardInfo:
    return pb.ShardInfo(path=shard.path, size_bytes=shard.size_bytes, checksum=shard.checksum,
                        rank=shard.rank)


def checkpoint_to_pb(ckpt: Checkpoint) -> pb.Checkpoint:
    return pb.Checkpoint(
        id=ckpt.id, job_id=ckpt.job_id, attempt=ckpt.attempt, step=ckpt.step, world_size=ckpt.world_size,
        location=ckpt.location, state=_STATE_TO_PB[ckpt.state],
        shards=[shard_to_pb(s) for s in ckpt.shards], total_bytes=ckpt.total_bytes,
        created_at=_timestamp(ckpt.created_at), committed_at=_timestamp(ckpt.committed_at),
        tags=list(ckpt.tags), metadata=dict(ckpt.metadata))
