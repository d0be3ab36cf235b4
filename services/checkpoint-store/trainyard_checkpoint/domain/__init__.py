"""Pure checkpoint domain: the record, its state machine, retention, GC decisions and request validation
(no grpc, no etcd, no storage)."""

from .checkpoint import (
    MANIFEST_NAME,
    TRANSITIONS,
    Checkpoint,
    CheckpointState,
    Lineage,
    Shard,
    abort,
    attempt_problem,
    can_transition,
    canonical_shards,
    commit,
    delete,
    fallback_latest,
    mark_damaged,
    moves_latest,
    new_checkpoint,
    step_problem,
    storage_problems,
    tag,
    untag,
)
from .retention import RetentionPolicy, keep_reasons, validate_policy
from .validation import BeginRequest

__all__ = [
    "MANIFEST_NAME", "TRANSITIONS", "BeginRequest", "Checkpoint", "CheckpointState", "Lineage",
    "RetentionPolicy", "Shard", "abort", "attempt_problem", "can_transition", "canonical_shards", "commit", "delete",
    "fallback_latest", "keep_reasons", "mark_damaged", "moves_latest", "new_checkpoint", "step_problem",
    "storage_problems", "tag", "untag",
    "validate_policy",
]
