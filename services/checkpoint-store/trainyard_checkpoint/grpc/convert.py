"""The one place where protobuf messages become domain values and back. No decisions here: validation
is the domain's (so an out-of-range proto value reaches it unchanged and is refused with a message)."""

from __future__ import annotations

from collections.abc import Sequence

from google.protobuf.timestamp_pb2 import Timestamp

from trainyard.checkpoint.v1 import checkpoint_pb2 as pb

from ..domain import MANIFEST_NAME, Checkpoint, CheckpointState, Lineage, RetentionPolicy, Shard
from ..domain.gc import ActionKind, GcAction
from ..domain.validation import BeginRequest

_STATE_TO_PB: dict[CheckpointState, pb.CheckpointState.ValueType] = {
    CheckpointState.WRITING: pb.CHECKPOINT_STATE_WRITING,
    CheckpointState.COMMITTED: pb.CHECKPOINT_STATE_COMMITTED,
    CheckpointState.ABORTED: pb.CHECKPOINT_STATE_ABORTED,
    CheckpointState.DELETED: pb.CHECKPOINT_STATE_DELETED,
    CheckpointState.DAMAGED: pb.CHECKPOINT_STATE_DAMAGED,
}

_ACTION_TO_PB: dict[ActionKind, pb.GcActionKind.ValueType] = {
    ActionKind.ABORT_ABANDONED: pb.GC_ACTION_KIND_ABORT_ABANDONED,
    ActionKind.DELETE_BY_RETENTION: pb.GC_ACTION_KIND_DELETE_BY_RETENTION,
    ActionKind.REMOVE_ABORTED: pb.GC_ACTION_KIND_REMOVE_ABORTED,
    ActionKind.REMOVE_ORPHAN: pb.GC_ACTION_KIND_REMOVE_ORPHAN,
    ActionKind.PURGE_TOMBSTONE: pb.GC_ACTION_KIND_PURGE_TOMBSTONE,
    ActionKind.REMOVE_DAMAGED: pb.GC_ACTION_KIND_REMOVE_DAMAGED,
}


def _timestamp(seconds: float | None) -> Timestamp | None:
    if seconds is None:
        return None
    ts = Timestamp()
    ts.FromNanoseconds(round(seconds * 1e9))
    return ts


def lineage(msg: pb.Lineage) -> Lineage:
    return Lineage(job_spec=msg.job_spec, code_version=msg.code_version, parameters=dict(msg.parameters))


def policy(msg: pb.RetentionPolicy) -> RetentionPolicy:
    return RetentionPolicy(keep_last=msg.keep_last, keep_every_steps=msg.keep_every_steps)


def policy_to_pb(value: RetentionPolicy) -> pb.RetentionPolicy:
    return pb.RetentionPolicy(keep_last=value.keep_last, keep_every_steps=value.keep_every_steps)


def begin_request(req: pb.BeginCheckpointRequest) -> BeginRequest:
    return BeginRequest(job_id=req.job_id, attempt=req.attempt, step=req.step, world_size=req.world_size,
                        metadata=dict(req.metadata), lineage=lineage(req.lineage),
                        retention=policy(req.retention) if req.HasField("retention") else None)


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
        aborted_at=_timestamp(ckpt.aborted_at), deleted_at=_timestamp(ckpt.deleted_at),
        abort_reason=ckpt.abort_reason, damaged_at=_timestamp(ckpt.damaged_at), damage=ckpt.damage,
        tags=list(ckpt.tags), metadata=dict(ckpt.metadata),
        lineage=pb.Lineage(job_spec=ckpt.lineage.job_spec, code_version=ckpt.lineage.code_version,
                           parameters=dict(ckpt.lineage.parameters)),
        manifest_path=MANIFEST_NAME if ckpt.committed_at is not None else "")


def gc_action_to_pb(action: GcAction) -> pb.GcAction:
    return pb.GcAction(kind=_ACTION_TO_PB[action.kind], job_id=action.job_id, checkpoint_id=action.checkpoint_id,
                       location=action.location, reason=action.reason)
