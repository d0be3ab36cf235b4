"""The checkpoint record and its state machine. Pure: no grpc, no etcd, no filesystem, no clock.

States and transitions
----------------------
::

    Begin ──▶ WRITING ──Commit──▶ COMMITTED ──Delete / GC retention──▶ DELETED ──GC──▶ (purged)
                 │                     │                                 ▲  ▲
                 │                     └──ReportDamaged──▶ DAMAGED ──────┘  │ Delete / GC grace
                 └──Abort / GC abandon──▶ ABORTED ──Delete / GC grace───────┘

- WRITING: an id and a location are reserved; workers write their shards straight to the location
  (the data never passes through this service). Nothing may restore from it. A commit that finds a
  bad shard (missing, wrong size, checksum mismatch) leaves it WRITING: the client may rewrite the
  shard and commit again, or abort. GC aborts a WRITING checkpoint older than `gc_abandon_writing_s`.
- COMMITTED: every declared shard was found in storage with its declared size and (with
  `commit_verify=checksum`) its declared checksum; the shard list is frozen. Only the tags change
  afterwards (TagCheckpoint / UntagCheckpoint), and then the state, to DELETED.
- ABORTED: the save was given up (a worker died, the job was cancelled, GC found it abandoned). Abort
  does not touch storage: workers that have not noticed yet may still be writing. GC removes the
  files `gc_grace_s` after the abort (and marks the record DELETED); Delete does so at once.
- DAMAGED: a committed checkpoint whose files were later found damaged (a reader's checksum failed, a
  shard went missing) and confirmed by the service reading the named shards again. Nothing restores
  from it. When it was the job's `latest`, the pointer moves back to the job's newest remaining
  COMMITTED checkpoint (or is removed when there is none) in the same transaction, so the job can save
  again at the steps after that one. Its files stay `gc_grace_s` for inspection, then GC removes them
  (unless it is tagged: an operator keeps it by tagging it before it is marked, and deletes it by hand).
- DELETED: a tombstone; the files are gone (or being removed: Delete marks first, then removes, and is
  idempotent so a retry finishes the job). GC drops the record `gc_tombstone_retention_s` later, once
  the files are gone.

Every transition is idempotent where repeating it is harmless: Commit of a COMMITTED checkpoint with
the same shards returns it unchanged; Abort of an ABORTED one (or of one deleted after it was aborted)
returns it unchanged; Delete of a DELETED one returns it unchanged; tagging with a tag it has, or
untagging one it lacks, changes nothing. Anything else out of order is a FailedPrecondition that
names the state.

Delete (and GC) never removes a checkpoint that is the job's `latest`, that carries a tag, or that is
under a restore lease; WRITING ones are aborted first.

Commit order
------------
1. validate the declared shards (paths, sizes, ranks, checksums) against the record;
2. verify storage: every shard exists as a regular file of the declared size, and (checksum mode)
   its bytes match the declared checksum; any problem → FailedPrecondition naming the shards (and the
   chunk), nothing written, the checkpoint stays WRITING;
3. write the manifest `.trainyard-manifest.json` into the location, LAST among the files: POSIX
   writes a temporary name, fsyncs it, links/renames it into place and fsyncs the directory; S3 puts
   it with If-None-Match. An existing manifest with other content refuses the commit;
4. one etcd transaction: the record becomes COMMITTED (guarded by its mod revision) and, when the
   step is higher than the latest's, the job's `latest` pointer moves to it (guarded by the pointer's
   mod revision). A lost race re-reads and decides again.
So a manifest in storage means "verified"; etcd alone says "committed". A manifest without a
committed record (the transaction lost to an abort) is removed with the aborted checkpoint.

Who writes which key (all keys under the service's `etcd_prefix`)
----------------------------------------------------------------
- `checkpoints/<job_id>/<checkpoint_id>`: the JSON record. Created by Begin (WRITING), rewritten by
  Commit, Abort, Delete, Tag/Untag and GC, each a compare-and-swap on the record's mod revision; GC
  drops it (purge) the same way. Only this service writes it. Checkpoint ids sort by creation time,
  so a job's keys list in creation order.
- `checkpoint-ids/<checkpoint_id>`: the job id, written once by Begin in the same transaction as the
  record, dropped with it by the purge. The RPCs name a checkpoint by id alone; this index finds its job.
- `checkpoints-latest/<job_id>`: the id of the job's latest COMMITTED checkpoint. Moved forward in
  step (`moves_latest`) by Commit, in the same transaction as the record, guarded by the pointer's mod
  revision. The one move backwards is ReportDamaged on the latest: in the transaction that marks it
  DAMAGED, the pointer moves to `fallback_latest` (guarded by that record's revision too) or is removed.
  Delete refuses the checkpoint it names, so it never points at
  anything but a COMMITTED record.
- `checkpoint-retention/<job_id>`: the job's retention policy (JSON), written by SetRetention and by
  Begin when it carries one. Read by GC.
- `checkpoint-leases/<job_id>/<checkpoint_id>/<lease_id>`: one key per restore lease, bound to an etcd
  lease of the requested TTL, so etcd removes it when the lease expires. Written by
  AcquireRestoreLease in a transaction guarded by the record's mod revision (COMMITTED);
  ReleaseRestoreLease revokes the etcd lease.
- `checkpoint-lease-guard/<job_id>`: rewritten by every AcquireRestoreLease. A deletion reads it before
  listing the job's leases and requires it unchanged in its transaction, so a lease taken after the
  look cannot be missed.
- `checkpoint-gc-lock`: held (bound to an etcd lease) by the replica running a GC pass; one pass at a
  time across replicas.
- `checkpoint-attempts/<job_id>`: the highest attempt of the job that has begun a checkpoint, raised by
  Begin in the transaction that creates the record. Begin and Commit of an older attempt are refused
  (`attempt_problem`), and both transactions require the key unchanged since it was read, so a stale
  attempt cannot slip a commit in after a newer attempt began.
- Storage (`<root>/<job_id>/<checkpoint_id>/`): shard files are written by the training workers while
  WRITING; this service creates the directory at Begin (POSIX; S3 has no directories), reads the shards
  at Commit, writes the manifest, and removes the directory at Delete and GC.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from trainyard_core.errors import FailedPrecondition

# An abort reason is informational: long ones (a traceback) are cut rather than refused, because
# refusing an abort would leave the checkpoint WRITING.
MAX_ABORT_REASON_CHARS = 1024
# The file the service writes into a checkpoint's location at commit. Names starting with this prefix
# are the service's own: a worker may not declare a shard under one.
RESERVED_PREFIX = ".trainyard-"
MANIFEST_NAME = ".trainyard-manifest.json"
MAX_TAGS = 16


class CheckpointState(enum.StrEnum):
    WRITING = "WRITING"
    COMMITTED = "COMMITTED"
    ABORTED = "ABORTED"
    DELETED = "DELETED"
    DAMAGED = "DAMAGED"


TRANSITIONS: Mapping[CheckpointState, frozenset[CheckpointState]] = {
    CheckpointState.WRITING: frozenset({CheckpointState.COMMITTED, CheckpointState.ABORTED}),
    CheckpointState.COMMITTED: frozenset({CheckpointState.DELETED, CheckpointState.DAMAGED}),
    CheckpointState.ABORTED: frozenset({CheckpointState.DELETED}),
    CheckpointState.DAMAGED: frozenset({CheckpointState.DELETED}),
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
class Lineage:
    """Where a checkpoint comes from, as the job declared it at Begin. Never changed afterwards.

    `job_spec` is the job's spec as submitted (a JSON object, as text), `code_version` e.g. a git
    commit, `parameters` the run's parameters. Together with the record's job, attempt, step, world
    size and times this traces a checkpoint back to the run that made it.
    """

    job_spec: str = ""
    code_version: str = ""
    parameters: Mapping[str, str] = field(default_factory=dict)


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
    damaged_at: float | None = None
    damage: str = ""
    tags: tuple[str, ...] = ()
    metadata: Mapping[str, str] = field(default_factory=dict)
    lineage: Lineage = field(default_factory=Lineage)

    @property
    def total_bytes(self) -> int:
        return sum(s.size_bytes for s in self.shards)


def new_checkpoint(*, checkpoint_id: str, job_id: str, attempt: int, step: int, world_size: int,
                   location: str, metadata: Mapping[str, str], now: float,
                   lineage: Lineage | None = None) -> Checkpoint:
    """The record Begin creates. Inputs are validated already (see validation.validate_begin)."""
    return Checkpoint(id=checkpoint_id, job_id=job_id, attempt=attempt, step=step, world_size=world_size,
                      location=location, state=CheckpointState.WRITING, created_at=now,
                      metadata=dict(metadata), lineage=lineage or Lineage())


def step_problem(step: int, latest: Checkpoint | None) -> str | None:
    """Why a new checkpoint at `step` would go backwards, or None.

    A job's steps grow; a Begin at or below the latest committed step is a client bug (a restarted job
    that did not resume, a step counter reset) and would never become `latest` anyway.
    """
    if latest is None or step > latest.step:
        return None
    return (f"step {step} is not after step {latest.step} of job {latest.job_id}'s latest committed "
            f"checkpoint {latest.id}; a new checkpoint must have a higher step")


def attempt_problem(job_id: str, attempt: int, fence: int | None) -> str | None:
    """Why checkpoint work of `attempt` is refused, or None. `fence` is the highest attempt of the job that
    has begun a checkpoint: once a restarted job's new attempt saves, workers of an older attempt still
    running somewhere (a node that lost contact, a partition) must not begin or commit checkpoints, or
    they could move `latest` under the new attempt."""
    if fence is None or attempt >= fence:
        return None
    return (f"attempt {attempt} of job {job_id} is stale: attempt {fence} has begun checkpoints since; "
            "workers of an old attempt must stop (the job was restarted)")


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
    if ckpt.state in (CheckpointState.DELETED, CheckpointState.DAMAGED):
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


def delete(ckpt: Checkpoint, *, latest_id: str | None, leases: int = 0, now: float) -> Checkpoint:
    """COMMITTED, DAMAGED or ABORTED → DELETED. Idempotent on a deleted checkpoint.

    `latest_id` is the job's current latest pointer: the latest checkpoint is what a restarting job
    resumes from, so deleting it is refused (commit a newer one first). A tagged checkpoint is refused
    (untag it first), and so is one with `leases` > 0 active restore leases (a job is loading it).
    """
    if ckpt.state is CheckpointState.DELETED:
        return ckpt
    if ckpt.state is CheckpointState.WRITING:
        raise _refuse(ckpt, "deleted", "; abort it first")
    if ckpt.id == latest_id:
        raise FailedPrecondition(f"checkpoint {ckpt.id} is the latest checkpoint of job {ckpt.job_id}; "
                                 "a restarting job resumes from it, so it cannot be deleted until a "
                                 "newer checkpoint is committed")
    if ckpt.tags:
        raise FailedPrecondition(f"checkpoint {ckpt.id} is tagged {', '.join(ckpt.tags)}; untag it "
                                 "before deleting it")
    if leases:
        raise FailedPrecondition(f"checkpoint {ckpt.id} is being restored ({leases} active restore "
                                 "lease(s)); delete it after they are released or expire")
    return replace(ckpt, state=CheckpointState.DELETED, deleted_at=now)


def mark_damaged(ckpt: Checkpoint, damage: str, now: float) -> Checkpoint:
    """COMMITTED → DAMAGED, with what was found (already confirmed in storage by the caller).
    Idempotent on a DAMAGED checkpoint (the first finding is kept)."""
    if ckpt.state is CheckpointState.DAMAGED:
        return ckpt
    if ckpt.state is not CheckpointState.COMMITTED:
        raise _refuse(ckpt, "marked damaged", "; only committed checkpoints are restored from")
    return replace(ckpt, state=CheckpointState.DAMAGED, damaged_at=now, damage=damage[:MAX_ABORT_REASON_CHARS])


def fallback_latest(checkpoints: Iterable[Checkpoint], excluded: str) -> Checkpoint | None:
    """Where the latest pointer goes when checkpoint `excluded` (the latest) is found damaged: the job's
    COMMITTED checkpoint with the highest step (ties: the newest id), other than `excluded`; None when
    there is none."""
    committed = [c for c in checkpoints if c.state is CheckpointState.COMMITTED and c.id != excluded]
    return max(committed, key=lambda c: (c.step, c.id), default=None)


def tag(ckpt: Checkpoint, name: str) -> Checkpoint:
    """Add a tag to a COMMITTED checkpoint (idempotent). The tag name is validated already."""
    if ckpt.state is not CheckpointState.COMMITTED:
        raise _refuse(ckpt, "tagged", "; only committed checkpoints are tagged")
    if name in ckpt.tags:
        return ckpt
    if len(ckpt.tags) >= MAX_TAGS:
        raise FailedPrecondition(f"checkpoint {ckpt.id} already has {MAX_TAGS} tags, the most allowed")
    return replace(ckpt, tags=tuple(sorted((*ckpt.tags, name))))


def untag(ckpt: Checkpoint, name: str) -> Checkpoint:
    """Remove a tag (idempotent: a tag the checkpoint lacks changes nothing, in any state)."""
    if name not in ckpt.tags:
        return ckpt
    return replace(ckpt, tags=tuple(t for t in ckpt.tags if t != name))


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
