"""The checkpoint record and its state machine. Pure: no grpc, no etcd, no filesystem, no clock.

States and transitions
----------------------
::

    Begin ──▶ WRITING ──Commit──▶ COMMITTED ──Delete──▶ DELETED
                 │                                         ▲
                 └──Abort───▶ ABORTED ──────Delete─────────┘

- WRITING: an id and a location are reserved; workers write their shards straight to the location
  (the data never passes through this service). Nothing may restore from it.
- COMMITTED: every declared shard was found in storage with its declared size; the shard list
  (path, size, checksum, rank) is frozen and the record never changes again except to DELETED.
- ABORTED: the save was given up (a worker died, the job was cancelled). Shard files may remain;
  workers that have not noticed yet can still be writing, so Abort does not touch storage. Delete
  removes them (issue 5 adds a garbage collector for orphaned shards).
- DELETED: a tombstone; the files are gone (or being removed: Delete marks first, then removes, and is
  idempotent so a retry finishes the job). Kept so that a reader holding the id gets a clear answer.

Every transition is idempotent where repeating it is harmless: Commit of a COMMITTED checkpoint with
the same shards returns it unchanged; Abort of an ABORTED one (or of one deleted after it was aborted)
returns it unchanged; Delete of a DELETED one returns it unchanged. Anything else out of order is a
FailedPrecondition that names the state.

Who writes which key (all keys under the service's `etcd_prefix`)
----------------------------------------------------------------
- `checkpoints/<job_id>/<checkpoint_id>`: the JSON record. Created by Begin (WRITING), rewritten only by
  Commit, Abort and Delete, each a compare-and-swap on the record's mod revision. Only this service
  writes it. Checkpoint ids sort by creation time, so a job's keys list in creation order.
- `checkpoint-ids/<checkpoint_id>`: the job id, written once by Begin in the same transaction as the
  record, never changed. The RPCs name a checkpoint by id alone; this index finds its job.
- `checkpoints-latest/<job_id>`: the id of the job's latest COMMITTED checkpoint. Moved only by
  Commit, in the same transaction as the record, guarded by the pointer's mod revision; it only moves
  forward in step (`moves_latest`). Delete refuses the checkpoint it names (and guards that with the
  same revision), so it never points at anything but a COMMITTED record.
- Storage (`<root>/<job_id>/<checkpoint_id>/`): shard files are written by the training workers while
  WRITING; this service creates the directory at Begin, only reads sizes at Commit, and removes the
  directory at Delete.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from trainyard_core.errors import FailedPrecondition

# An abort reason is informational: long ones (a traceback) are cut rather than refused, because
# refusing an abort would leave the checkpoint WRITING.
MAX_ABORT_REASON_CHARS = 1024


class CheckpointState(enum.StrEnum):
    WRITING = "WRITING"
    COMMITTED = "COMMITTED"
    ABORTED = "ABORTED"
    DELETED = "DELETED"


TRANSITIONS: Mapping[CheckpointState, frozenset[CheckpointState]] = {
    CheckpointState.WRITING: frozenset({CheckpointState.COMMITTED, CheckpointState.ABORTED}),
    CheckpointState.COMMITTED: frozenset({CheckpointState.DELETED}),
    CheckpointState.ABORTED: frozenset({CheckpointState.DELETED}),
    CheckpointState.DELETED: frozenset(),
}


def can_transition(src: CheckpointState, dst: CheckpointState) -> bool:
    return dst in TRANSITIONS[src]


@dataclass(frozen=True, slots=True, order=True)
class Shard:
    """One file of a checkpoint, as declared by the worker that wrote it.

    `path` is relative to the checkpoint's location; `checksum` is recorded as given (`crc32c:<8 hex>`
    or `xxh3:<16 hex>`) and verified by readers. Ordering (rank, then path) gives records a canonical
    shard order.
    """

    rank: int
    path: str
    size_bytes: int
    checksum: str


@dataclass(frozen=True, slots=True)
class Checkpoint:
    id: str
    job_id: str
    attempt: int
    step: int
    world_size: int
    # URL of the checkpoint's directory (file:///root/<job_id>/<id>).
    location: str
    state: CheckpointState
    created_at: float
    shards: tuple[Shard, ...] = ()
    committed_at: float | None = None
    aborted_at: float | None = None
    deleted_at: float | None = None
    abort_reason: str = ""
    tags: tuple[str, ...] = ()
    metadata: Mapping[str, str] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(s.size_bytes for s in self.shards)


def new_checkpoint(*, checkpoint_id: str, job_id: str, attempt: int, step: int, world_size: int,
                   location: str, metadata: Mapping[str, str], now: float) -> Checkpoint:
    """The record Begin creates. Inputs are validated already (see validation.validate_begin)."""
    return Checkpoint(id=checkpoint_id, job_id=job_id, attempt=attempt, step=step, world_size=world_size,
                      location=location, state=CheckpointState.WRITING, created_at=now,
                      metadata=dict(metadata))


def canonical_shards(shards: Sequence[Shard]) -> tuple[Shard, ...]:
    return tuple(sorted(shards))


def _refuse(ckpt: Checkpoint, action: str, why: str) -> FailedPrecondition:
    return FailedPrecondition(f"checkpoint {ckpt.id} cannot be {action}: it is {ckpt.state.value}{why}")


def commit(ckpt: Checkpoint, shards: Sequence[Shard], now: float) -> Checkpoint:
    """WRITING → COMMITTED with `shards` (already validated and found in storage).

    Idempotent: a COMMITTED checkpoint with the same shards (in any order) is returned unchanged, so a
    client that lost the answer to its Commit can simply send it again.
    """
    wanted = canonical_shards(shards)
    if ckpt.state is CheckpointState.COMMITTED:
        if ckpt.shards == wanted:
            return ckpt
        raise _refuse(ckpt, "committed again", " with a different shard list (commit is idempotent "
                      "only with the same shards)")
    if ckpt.state is CheckpointState.ABORTED:
        reason = f" ({ckpt.abort_reason})" if ckpt.abort_reason else ""
        raise _refuse(ckpt, "committed", f"{reason}; begin a new checkpoint")
    if ckpt.state is CheckpointState.DELETED:
        raise _refuse(ckpt, "committed", "; begin a new checkpoint")
    return replace(ckpt, state=CheckpointState.COMMITTED, shards=wanted, committed_at=now)


def abort(ckpt: Checkpoint, reason: str, now: float) -> Checkpoint:
    """WRITING → ABORTED. Idempotent on an aborted checkpoint (also after it was deleted)."""
    if ckpt.state is CheckpointState.ABORTED or (
            ckpt.state is CheckpointState.DELETED and ckpt.aborted_at is not None):
        return ckpt
    if ckpt.state is not CheckpointState.WRITING:
        why = "; delete it instead" if ckpt.state is CheckpointState.COMMITTED else ""
        raise _refuse(ckpt, "aborted", why)
    return replace(ckpt, state=CheckpointState.ABORTED, aborted_at=now,
                   abort_reason=reason[:MAX_ABORT_REASON_CHARS])


def delete(ckpt: Checkpoint, *, latest_id: str | None, now: float) -> Checkpoint:
    """COMMITTED or ABORTED → DELETED. Idempotent on a deleted checkpoint.

    `latest_id` is the job's current latest pointer: the latest checkpoint is what a restarting job
    resumes from, so deleting it is refused (commit a newer one first).
    """
    if ckpt.state is CheckpointState.DELETED:
        return ckpt
    if ckpt.state is CheckpointState.WRITING:
        raise _refuse(ckpt, "deleted", "; abort it first")
    if ckpt.id == latest_id:
        raise FailedPrecondition(f"checkpoint {ckpt.id} is the latest checkpoint of job {ckpt.job_id}; "
                                 "a restarting job resumes from it, so it cannot be deleted until a "
                                 "newer checkpoint is committed")
    return replace(ckpt, state=CheckpointState.DELETED, deleted_at=now)


def moves_latest(latest_step: int | None, committed_step: int) -> bool:
    """Whether committing a checkpoint at `committed_step` moves the job's latest pointer.

    Only forward: a commit at an older (or equal) step than the current latest, e.g. a slow save that
    finishes after a newer one, leaves the pointer where it is. The first commit always moves it.
    """
    return latest_step is None or committed_step > latest_step


def storage_problems(declared: Sequence[Shard], observed: Mapping[str, int | None]) -> list[str]:
    """Compare declared shards with the sizes found in storage (None: missing); one message per shard.

    A size smaller than declared is the classic truncated write; a larger one means the file was
    written again after the worker declared it. Either way the checkpoint is not what was declared.
    """
    problems: list[str] = []
    for shard in declared:
        actual = observed.get(shard.path)
        if actual is None:
            problems.append(f"shard {shard.path!r} (rank {shard.rank}) is missing")
        elif actual < shard.size_bytes:
            problems.append(f"shard {shard.path!r} (rank {shard.rank}) is truncated: {actual} bytes in "
                            f"storage, {shard.size_bytes} declared")
        elif actual > shard.size_bytes:
            problems.append(f"shard {shard.path!r} (rank {shard.rank}) has {actual} bytes in storage, "
                            f"{shard.size_bytes} declared")
    return problems
