"""Pure checkpoint domain: the record, its state machine and request validation (no grpc, no etcd)."""

from .checkpoint import (
    TRANSITIONS,
    Checkpoint,
    CheckpointState,
    Shard,
    abort,
    can_transition,
    canonical_shards,
    commit,
    delete,
    moves_latest,
    new_checkpoint,
    storage_problems,
)
from .validation import BeginRequest

__all__ = [
    "TRANSITIONS", "BeginRequest", "Checkpoint", "CheckpointState", "Shard", "abort", "can_transition",
    "canonical_shards", "commit", "delete", "moves_latest", "new_checkpoint", "storage_problems",
]
