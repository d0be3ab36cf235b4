"""Garbage collection, the decision half: a snapshot of records and storage in, actions out. Pure.

The GC runner (`gc.py` beside `manager.py`) loads the snapshot, calls `plan`, and applies each action
as its own compare-and-swap guarded by the revisions in the snapshot, so an action decided on a stale
view (a tag added, a lease taken, a checkpoint committed meanwhile) fails and is decided again on the
next pass. Rules, per record:

- WRITING: kept while younger than `abandon_writing_s` (from created_at); then ABORT_ABANDONED.
  Its files stay for now: the workers may still be writing.
- COMMITTED: kept when the job's retention keeps it (`retention.keep_reasons`: latest, tagged, leased,
  keep_last, keep_every_steps; everything without a policy); else DELETE_BY_RETENTION.
- ABORTED: REMOVE_ABORTED once `grace_s` has passed since aborted_at (record DELETED, files removed).
- DAMAGED: REMOVE_DAMAGED once `grace_s` has passed since damaged_at, unless it is tagged (kept for
  inspection until an operator deletes it).
- DELETED: files still in storage (a failed removal, a straggling worker) → REMOVE_ORPHAN once `grace_s`
  has passed since deleted_at; no files and `tombstone_retention_s` passed → PURGE_TOMBSTONE.

And per location in storage with no record at all (a Begin whose record write failed, a record purged
while a straggler wrote, files copied in by hand): REMOVE_ORPHAN once this GC has seen it for `grace_s`.
The time is first-seen by GC, not the storage's modification time: that works the same on S3 (where a
prefix has no time) and does not depend on the storage servers' clocks.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .checkpoint import Checkpoint, CheckpointState
from .retention import RetentionPolicy, keep_reasons


class ActionKind(enum.StrEnum):
    ABORT_ABANDONED = "ABORT_ABANDONED"
    DELETE_BY_RETENTION = "DELETE_BY_RETENTION"
    REMOVE_ABORTED = "REMOVE_ABORTED"
    REMOVE_DAMAGED = "REMOVE_DAMAGED"
    REMOVE_ORPHAN = "REMOVE_ORPHAN"
    PURGE_TOMBSTONE = "PURGE_TOMBSTONE"


@dataclass(frozen=True, slots=True)
class GcTiming:
    grace_s: float
    abandon_writing_s: float
    tombstone_retention_s: float


@dataclass(frozen=True, slots=True)
class VersionedCheckpoint:
    checkpoint: Checkpoint
    mod_revision: int


@dataclass(frozen=True, slots=True)
class JobSnapshot:
    job_id: str
    records: Sequence[VersionedCheckpoint]
    latest_id: str | None
    policy: RetentionPolicy | None
    # Active restore leases per checkpoint id, and the revision of the job's lease guard key that was
    # read before them (every deletion of this job is guarded by it).
    leased: Mapping[str, int]
    lease_guard_revision: int


@dataclass(frozen=True, slots=True)
class StoredLocation:
    job_id: str
    checkpoint_id: str
    location: str


@dataclass(frozen=True, slots=True)
class GcAction:
    kind: ActionKind
    job_id: str
    checkpoint_id: str
    location: str
    reason: str
    # The record's mod revision in the snapshot (0: no record); the action's transaction requires it.
    revision: int = 0
    lease_guard_revision: int = 0


def plan(jobs: Sequence[JobSnapshot], stored: Sequence[StoredLocation], first_seen: Mapping[str, float],
         timing: GcTiming, now: float) -> list[GcAction]:
    """The actions a GC pass takes now. `first_seen` maps storage locations without a record to the time
    this GC first saw them."""
    actions: list[GcAction] = []
    in_storage = {s.location for s in stored}
    recorded: set[str] = set()
    for job in jobs:
        reasons = keep_reasons((r.checkpoint for r in job.records), job.policy, latest_id=job.latest_id,
                               leased=job.leased)
        for rec in job.records:
            c = rec.checkpoint
            recorded.add(c.location)
            act = _recorder(actions, rec, job.lease_guard_revision)
            if c.state is CheckpointState.WRITING:
                if now - c.created_at >= timing.abandon_writing_s:
                    act(ActionKind.ABORT_ABANDONED, f"no commit {timing.abandon_writing_s:g}s after begin")
            elif c.state is CheckpointState.COMMITTED:
                if not reasons.get(c.id, "keep"):
                    act(ActionKind.DELETE_BY_RETENTION, _retention_reason(job.policy))
            elif c.state is CheckpointState.ABORTED:
                if now - (c.aborted_at or c.created_at) >= timing.grace_s:
                    act(ActionKind.REMOVE_ABORTED, f"aborted more than {timing.grace_s:g}s ago")
            elif c.state is CheckpointState.DAMAGED:
                if not c.tags and now - (c.damaged_at or c.created_at) >= timing.grace_s:
                    act(ActionKind.REMOVE_DAMAGED, f"found damaged more than {timing.grace_s:g}s ago")
            elif c.state is CheckpointState.DELETED:
                deleted_at = c.deleted_at or c.created_at
                if c.location in in_storage:
                    if now - deleted_at >= timing.grace_s:
                        act(ActionKind.REMOVE_ORPHAN, "files left after the checkpoint was deleted")
                elif now - deleted_at >= timing.tombstone_retention_s:
                    act(ActionKind.PURGE_TOMBSTONE, f"deleted more than {timing.tombstone_retention_s:g}s ago")
    for s in stored:
        if s.location in recorded:
            continue
        seen = first_seen.get(s.location)
        if seen is not None and now - seen >= timing.grace_s:
            actions.append(GcAction(ActionKind.REMOVE_ORPHAN, s.job_id, s.checkpoint_id, s.location,
                                    f"no checkpoint record for {timing.grace_s:g}s"))
    return actions


def _recorder(actions: list[GcAction], rec: VersionedCheckpoint, guard: int) -> Callable[[ActionKind, str], None]:
    def act(kind: ActionKind, reason: str) -> None:
        c = rec.checkpoint
        actions.append(GcAction(kind, c.job_id, c.id, c.location, reason, rec.mod_revision, guard))

    return act


def _retention_reason(policy: RetentionPolicy | None) -> str:
    if policy is None:  # without a policy everything is kept; not reached
        return "no retention policy"
    rules = []
    if policy.keep_last:
        rules.append(f"keep_last={policy.keep_last}")
    if policy.keep_every_steps:
        rules.append(f"keep_every_steps={policy.keep_every_steps}")
    return "not kept by retention (" + ", ".join(rules) + "), not latest, tagged or leased"
