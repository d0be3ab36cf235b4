"""Checkpoint records in the store (etcd): key layout, JSON encoding and compare-and-swap writes.

Keys, under the service's `etcd_prefix` (see `domain/checkpoint.py` for who writes which and when):

- `{prefix}/checkpoints/<job_id>/<checkpoint_id>` → the record as JSON (`"v": 1`);
- `{prefix}/checkpoint-ids/<checkpoint_id>` → the job id (an immutable index: RPCs name only the id);
- `{prefix}/checkpoints-latest/<job_id>` → the id of the job's latest committed checkpoint;
- `{prefix}/checkpoint-retention/<job_id>` → the job's retention policy as JSON;
- `{prefix}/checkpoint-leases/<job_id>/<checkpoint_id>/<lease_id>` → a restore lease (bound to an etcd
  lease: etcd drops the key when it expires);
- `{prefix}/checkpoint-lease-guard/<job_id>` → rewritten by every lease acquisition (guards deletions);
- `{prefix}/checkpoint-gc-lock` → the replica running a GC pass (bound to an etcd lease);
- `{prefix}/checkpoint-attempts/<job_id>` → the highest attempt of the job that has begun a checkpoint
  (the attempt fence: an older attempt's Begin and Commit are refused), rewritten by every Begin and deleted
  with the job's last record (see `purge`), so it is there exactly while the job has records;
- `{prefix}/checkpoint-teams/<job_id>` → the job's team, as its first job credential named it (written once;
  the gateway and tools see only their team's jobs: `access.py`).

The fence, the team, the lease guard and the retention policy of a job leave etcd with its last record
(`purge`): a job's keys are bounded by its checkpoints, not kept for every job that ever saved one.

Every write is a transaction guarded by mod revisions read before it; a lost race returns False and the
caller re-reads and decides again. Nothing here holds a lock or waits on anything but the store.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from trainyard_core.errors import InvalidArgument, Unavailable
from trainyard_core.store import Compare, Delete, Put, Store, absent, mod_revision_is
from trainyard_core.store.api import Op

from .domain import Checkpoint, CheckpointState, Lineage, RetentionPolicy, Shard

RECORD_VERSION = 1
# etcd refuses requests over 1.5 MiB by default; stay clear of it with the whole transaction.
MAX_RECORD_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class StoredCheckpoint:
    checkpoint: Checkpoint
    mod_revision: int


@dataclass(frozen=True, slots=True)
class LeaseState:
    """A job's restore leases as read: active leases per checkpoint id, and the revision of the job's
    lease guard key read before them (0 when absent). A deletion guarded by that revision cannot miss
    a lease taken after the look."""

    leased: dict[str, int]
    guard_revision: int


@dataclass(frozen=True, slots=True)
class RestoreLease:
    job_id: str
    checkpoint_id: str
    lease_id: int
    holder: str
    ttl_s: int
    acquired_at: float = 0.0  # the service's clock when it was acquired (0: a record written without it)


@dataclass(frozen=True, slots=True)
class AttemptFence:
    """The highest attempt of a job that has begun a checkpoint (None: none yet), and the key's mod
    revision (0 when absent), which guards Begin and Commit."""

    attempt: int | None
    mod_revision: int


@dataclass(frozen=True, slots=True)
class LatestPointer:
    """The job's latest pointer as read: the checkpoint id (None when the job has none yet) and the
    pointer's mod revision (0 when absent), which guards any transaction that depends on it."""

    checkpoint_id: str | None
    mod_revision: int


def encode(ckpt: Checkpoint) -> bytes:
    doc: dict[str, Any] = {
        "v": RECORD_VERSION,
        "id": ckpt.id,
        "job_id": ckpt.job_id,
        "attempt": ckpt.attempt,
        "step": ckpt.step,
        "world_size": ckpt.world_size,
        "location": ckpt.location,
        "state": ckpt.state.value,
        "created_at": ckpt.created_at,
        "committed_at": ckpt.committed_at,
        "aborted_at": ckpt.aborted_at,
        "deleted_at": ckpt.deleted_at,
        "abort_reason": ckpt.abort_reason,
        "damaged_at": ckpt.damaged_at,
        "damage": ckpt.damage,
        "total_bytes": ckpt.total_bytes,
        "shards": [{"path": s.path, "size_bytes": s.size_bytes, "checksum": s.checksum, "rank": s.rank}
                   for s in ckpt.shards],
        "tags": list(ckpt.tags),
        "metadata": dict(ckpt.metadata),
        "lineage": {"job_spec": ckpt.lineage.job_spec, "code_version": ckpt.lineage.code_version,
                    "parameters": dict(ckpt.lineage.parameters)},
    }
    data = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
    if len(data) > MAX_RECORD_BYTES:
        raise InvalidArgument(f"checkpoint {ckpt.id}'s record would be {len(data)} bytes, more than the "
                              f"{MAX_RECORD_BYTES} the metadata store takes; declare fewer shards or "
                              "shorter paths")
    return data


def decode(data: bytes) -> Checkpoint:
    try:
        doc = json.loads(data)
        if doc.get("v") != RECORD_VERSION:
            raise ValueError(f"unknown record version {doc.get('v')!r}")
        return Checkpoint(
            id=doc["id"], job_id=doc["job_id"], attempt=int(doc["attempt"]), step=int(doc["step"]),
            world_size=int(doc["world_size"]), location=doc["location"],
            state=CheckpointState(doc["state"]), created_at=float(doc["created_at"]),
            shards=tuple(Shard(rank=int(s["rank"]), path=s["path"], size_bytes=int(s["size_bytes"]),
                               checksum=s["checksum"]) for s in doc["shards"]),
            committed_at=doc["committed_at"], aborted_at=doc["aborted_at"], deleted_at=doc["deleted_at"],
            abort_reason=doc["abort_reason"], damaged_at=doc.get("damaged_at"), damage=str(doc.get("damage", "")),
            tags=tuple(doc["tags"]), metadata=dict(doc["metadata"]),
            # Records written before lineage existed have none.
            lineage=_decode_lineage(doc.get("lineage") or {}))
    except (ValueError, KeyError, TypeError) as e:
        # A record this version cannot read is an operator problem, not the caller's: say so plainly.
        raise Unavailable(f"unreadable checkpoint record in the metadata store: {e}") from e


def _decode_lineage(doc: dict[str, Any]) -> Lineage:
    return Lineage(job_spec=str(doc.get("job_spec", "")), code_version=str(doc.get("code_version", "")),
                   parameters={str(k): str(v) for k, v in (doc.get("parameters") or {}).items()})


def encode_policy(policy: RetentionPolicy) -> bytes:
    return json.dumps({"v": 1, "keep_last": policy.keep_last, "keep_every_steps": policy.keep_every_steps},
                      sort_keys=True).encode()


def decode_policy(data: bytes) -> RetentionPolicy:
    try:
        doc = json.loads(data)
        return RetentionPolicy(keep_last=int(doc["keep_last"]), keep_every_steps=int(doc["keep_every_steps"]))
    except (ValueError, KeyError, TypeError) as e:
        raise Unavailable(f"unreadable retention policy in the metadata store: {e}") from e


# The repository has a method named `list`; inside the class these aliases name the builtin type.
_StoredList = list[StoredCheckpoint]


class CheckpointRepository:
    def __init__(self, store: Store, prefix: str) -> None:
        self._store = store
        self._prefix = prefix.rstrip("/")

    # -- keys ---------------------------------------------------------------------------------------
    def job_prefix(self, job_id: str) -> str:
        return f"{self._prefix}/checkpoints/{job_id}/"

    def record_key(self, job_id: str, checkpoint_id: str) -> str:
        return f"{self.job_prefix(job_id)}{checkpoint_id}"

    def index_key(self, checkpoint_id: str) -> str:
        return f"{self._prefix}/checkpoint-ids/{checkpoint_id}"

    def latest_key(self, job_id: str) -> str:
        return f"{self._prefix}/checkpoints-latest/{job_id}"

    def retention_key(self, job_id: str) -> str:
        return f"{self._prefix}/checkpoint-retention/{job_id}"

    def lease_prefix(self, job_id: str, checkpoint_id: str = "") -> str:
        return f"{self._prefix}/checkpoint-leases/{job_id}/" + (f"{checkpoint_id}/" if checkpoint_id else "")

    def lease_key(self, job_id: str, checkpoint_id: str, lease_id: int) -> str:
        return f"{self.lease_prefix(job_id, checkpoint_id)}{lease_id:x}"

    def lease_guard_key(self, job_id: str) -> str:
        return f"{self._prefix}/checkpoint-lease-guard/{job_id}"

    def attempt_key(self, job_id: str) -> str:
        return f"{self._prefix}/checkpoint-attempts/{job_id}"

    def team_key(self, job_id: str) -> str:
        return f"{self._prefix}/checkpoint-teams/{job_id}"

    @property
    def gc_lock_key(self) -> str:
        return f"{self._prefix}/checkpoint-gc-lock"

    @property
    def store(self) -> Store:
        return self._store

    # -- reads --------------------------------------------------------------------------------------
    async def load(self, checkpoint_id: str) -> StoredCheckpoint | None:
        index = await self._store.get(self.index_key(checkpoint_id))
        if index is None:
            return None
        kv = await self._store.get(self.record_key(index.value.decode(), checkpoint_id))
        if kv is None:
            return None
        return StoredCheckpoint(decode(kv.value), kv.mod_revision)

    async def load_in_job(self, job_id: str, checkpoint_id: str) -> StoredCheckpoint | None:
        kv = await self._store.get(self.record_key(job_id, checkpoint_id))
        return None if kv is None else StoredCheckpoint(decode(kv.value), kv.mod_revision)

    async def attempt_fence(self, job_id: str) -> AttemptFence:
        kv = await self._store.get(self.attempt_key(job_id))
        if kv is None:
            return AttemptFence(None, 0)
        try:
            return AttemptFence(int(kv.value), kv.mod_revision)
        except ValueError as e:
            raise Unavailable(f"unreadable attempt fence of job {job_id} in the metadata store: {e}") from e

    async def job_team(self, job_id: str) -> str | None:
        """The team recorded for the job's checkpoints; None when none is."""
        kv = await self._store.get(self.team_key(job_id))
        return None if kv is None else kv.value.decode(errors="replace")

    async def record_team(self, job_id: str, team: str) -> str:
        """Record the job's team unless one is recorded already; the team recorded afterwards."""
        key = self.team_key(job_id)
        result = await self._store.txn([absent(key)], [Put(key, team.encode())])
        if result.succeeded:
            return team
        recorded = await self.job_team(job_id)
        return team if recorded is None else recorded

    async def latest_pointer(self, job_id: str) -> LatestPointer:
        kv = await self._store.get(self.latest_key(job_id))
        if kv is None:
            return LatestPointer(None, 0)
        return LatestPointer(kv.value.decode(), kv.mod_revision)

    async def list(self, job_id: str, *, after: str | None, limit: int) -> tuple[list[Checkpoint], bool]:
        """A job's checkpoints in key order (= creation order), after the id `after`; and whether more
        follow."""
        prefix = self.job_prefix(job_id)
        result = await self._store.range(prefix, start_after=prefix + after if after else None,
                                         limit=limit)
        return [decode(kv.value) for kv in result.kvs], result.more

    async def list_all(self, *, page_size: int = 256) -> _StoredList:
        """Every record of every job, in key order (job, then creation), read page by page."""
        return await self._records_under(f"{self._prefix}/checkpoints/", page_size)

    async def _records_under(self, prefix: str, page_size: int) -> _StoredList:
        out: _StoredList = []
        after: str | None = None
        while True:
            result = await self._store.range(prefix, start_after=after, limit=page_size)
            out.extend(StoredCheckpoint(decode(kv.value), kv.mod_revision) for kv in result.kvs)
            if not result.more or not result.kvs:
                return out
            after = result.kvs[-1].key

    async def retention(self, job_id: str) -> RetentionPolicy | None:
        kv = await self._store.get(self.retention_key(job_id))
        return None if kv is None else decode_policy(kv.value)

    async def set_retention(self, job_id: str, policy: RetentionPolicy | None) -> None:
        """Last writer wins: a policy is one value set by an operator or the job, not a merge."""
        if policy is None:
            await self._store.delete(self.retention_key(job_id))
        else:
            await self._store.put(self.retention_key(job_id), encode_policy(policy))

    async def lease_state(self, job_id: str) -> LeaseState:
        """Read the guard FIRST, then the leases (see LeaseState)."""
        guard = await self._store.get(self.lease_guard_key(job_id))
        result = await self._store.range(self.lease_prefix(job_id))
        leased: dict[str, int] = {}
        for kv in result.kvs:
            checkpoint_id = kv.key[len(self.lease_prefix(job_id)):].split("/", 1)[0]
            leased[checkpoint_id] = leased.get(checkpoint_id, 0) + 1
        return LeaseState(leased, 0 if guard is None else guard.mod_revision)

    async def lease(self, job_id: str, checkpoint_id: str, lease_id: int) -> RestoreLease | None:
        kv = await self._store.get(self.lease_key(job_id, checkpoint_id, lease_id))
        if kv is None or kv.lease != lease_id:
            return None
        doc = json.loads(kv.value)
        return RestoreLease(job_id, checkpoint_id, lease_id, str(doc.get("holder", "")), int(doc.get("ttl_s", 0)),
                            float(doc.get("acquired_at", 0.0)))

    # -- writes -------------------------------------------------------------------------------------
    async def create(self, ckpt: Checkpoint, fence: AttemptFence) -> bool:
        """Store a new record and its id index, and raise the job's attempt fence to the record's attempt,
        if the fence is unchanged since it was read; False when a key exists already (an id clash) or
        the fence moved (decide again).

        The fence is written even when its value stays (a Begin of the attempt that raised it): every Begin
        moves its mod revision, which is how `purge` knows that no Begin slipped in while it decided to drop the
        fence with the job's last record. (A Commit of the job that read the fence before this Begin then loses
        its compare and decides again: one more round trip, when a job's Begin and Commit overlap.)"""
        record_key = self.record_key(ckpt.job_id, ckpt.id)
        index_key = self.index_key(ckpt.id)
        fence_key = self.attempt_key(ckpt.job_id)
        highest = ckpt.attempt if fence.attempt is None else max(fence.attempt, ckpt.attempt)
        ops: list[Op] = [Put(record_key, encode(ckpt)), Put(index_key, ckpt.job_id.encode()),
                         Put(fence_key, str(highest).encode())]
        result = await self._store.txn(
            [absent(record_key), absent(index_key), mod_revision_is(fence_key, fence.mod_revision)], ops)
        return result.succeeded

    async def update(self, ckpt: Checkpoint, *, expected_revision: int,
                     latest_guard: LatestPointer | None = None, move_latest: bool = False,
                     lease_guard_revision: int | None = None, fence: AttemptFence | None = None) -> bool:
        """Replace the record if unchanged since `expected_revision`, in one transaction.

        With `latest_guard`, the write also requires the job's latest pointer to be unchanged since it
        was read; with `move_latest`, the pointer is set to this checkpoint in the same transaction.
        With `lease_guard_revision`, it requires that no restore lease was taken on the job since the
        leases were read (a deletion). With `fence`, that the job's attempt fence did not move (a commit).
        """
        record_key = self.record_key(ckpt.job_id, ckpt.id)
        compares: list[Compare] = [mod_revision_is(record_key, expected_revision)]
        if lease_guard_revision is not None:
            compares.append(mod_revision_is(self.lease_guard_key(ckpt.job_id), lease_guard_revision))
        if fence is not None:
            compares.append(mod_revision_is(self.attempt_key(ckpt.job_id), fence.mod_revision))
        ops: list[Put] = [Put(record_key, encode(ckpt))]
        if latest_guard is not None or move_latest:
            if latest_guard is None:
                raise ValueError("moving the latest pointer needs the pointer's revision as a guard")
            compares.append(mod_revision_is(self.latest_key(ckpt.job_id), latest_guard.mod_revision))
        if move_latest:
            ops.append(Put(self.latest_key(ckpt.job_id), ckpt.id.encode()))
        result = await self._store.txn(compares, ops)
        return result.succeeded

    async def mark_damaged(self, damaged: Checkpoint, *, expected_revision: int, latest_guard: LatestPointer,
                           fallback: StoredCheckpoint | None, move_latest: bool) -> bool:
        """Write the DAMAGED record if unchanged since `expected_revision`; with `move_latest` (it was the
        latest), in the same transaction point the job's latest pointer at `fallback` (required unchanged
        since its revision, so still COMMITTED) or remove the pointer when `fallback` is None."""
        record_key = self.record_key(damaged.job_id, damaged.id)
        compares: list[Compare] = [mod_revision_is(record_key, expected_revision)]
        ops: list[Op] = [Put(record_key, encode(damaged))]
        if move_latest:
            latest_key = self.latest_key(damaged.job_id)
            compares.append(mod_revision_is(latest_key, latest_guard.mod_revision))
            if fallback is None:
                ops.append(Delete(latest_key))
            else:
                # The fallback's record is rewritten unchanged: that bumps its mod revision, so a Delete that
                # read the pointer before this transaction (and saw the fallback as deletable) loses its
                # compare-and-swap and decides again, finding it latest.
                fallback_key = self.record_key(damaged.job_id, fallback.checkpoint.id)
                compares.append(mod_revision_is(fallback_key, fallback.mod_revision))
                ops.append(Put(fallback_key, encode(fallback.checkpoint)))
                ops.append(Put(latest_key, fallback.checkpoint.id.encode()))
        result = await self._store.txn(compares, ops)
        return result.succeeded

    async def list_stored(self, job_id: str, *, page_size: int = 256) -> _StoredList:
        """Every record of one job with its mod revision, in creation order, read page by page."""
        return await self._records_under(self.job_prefix(job_id), page_size)

    async def purge(self, ckpt: Checkpoint, *, expected_revision: int) -> bool:
        """Drop a DELETED record and its id index, if unchanged since `expected_revision`; when it is the job's
        last record, its attempt fence goes in the same transaction, unless a Begin moved the fence meanwhile.

        Why the fence still fences although it goes:
        - Commit needs a WRITING record of its own, and the fence goes only with the job's last record. Every
          record is made by Begin, whose transaction writes the fence (`create`), so a record cannot exist
          without its fence: the fence is read here before the job's records are listed, and this transaction
          requires it unchanged. A Begin that committed before that read left a record the listing sees (and
          the fence stays); one that commits after it moved the fence (this transaction fails, and the plain
          purge below keeps the fence); one in flight read the fence before it went, so its own compare on
          the fence's revision fails and it decides again, from "no fence".
        - A Begin after the fence is gone writes a new fence, at its attempt. The scheduler's attempt numbers
          only grow, so a live attempt recreates it at least as high as the one it replaces. Left open is an
          attempt older than the deleted fence beginning again; for that, a stale worker would have to outlive
          the job's whole checkpoint history: the last record is purged no sooner than gc_tombstone_retention_s
          (7 days by default) after the job's last Begin (every record waits that long after it was deleted,
          which is after it was begun). Such a worker's credential names its attempt, and the scheduler renews
          an attempt's credential only while its allocation runs, which ends before the newer attempt is placed;
          so it expires within the scheduler's job_credential_ttl_s (1 hour by default, at most 7 days) of that
          (plus one renewal call in flight); and the agents kill a cut-off node's workers within
          worker_fence_s. Keep gc_tombstone_retention_s at least job_credential_ttl_s.

        Two GC passes that overlap (a lock that expired) and purge a job's last two records at once both see
        the other record and leave the fence: one key left behind, as before fences expired."""
        record_key = self.record_key(ckpt.job_id, ckpt.id)
        compares: list[Compare] = [mod_revision_is(record_key, expected_revision)]
        ops: list[Op] = [Delete(record_key), Delete(self.index_key(ckpt.id))]
        fence_key = self.attempt_key(ckpt.job_id)
        fence = await self._store.get(fence_key)  # before the listing: see above
        if fence is not None:
            records = await self._store.range(self.job_prefix(ckpt.job_id), limit=2)
            if [kv.key for kv in records.kvs] == [record_key]:
                # The job's other keys go with it too: its team (the next credential records it again), the
                # lease guard (no record is left to lease) and its retention policy (the next Begin names the
                # job's own again).
                job_keys = (fence_key, self.team_key(ckpt.job_id), self.lease_guard_key(ckpt.job_id),
                            self.retention_key(ckpt.job_id))
                last = await self._store.txn([*compares, mod_revision_is(fence_key, fence.mod_revision)],
                                             [*ops, *(Delete(k) for k in job_keys)])
                if last.succeeded:
                    return True
        result = await self._store.txn(compares, ops)
        return result.succeeded

    async def add_lease(self, ckpt: Checkpoint, *, expected_revision: int, lease_id: int, holder: str,
                        ttl_s: int, now: float) -> bool:
        """Record a restore lease on `ckpt` (bound to etcd lease `lease_id`) if the record is unchanged
        since `expected_revision`, and touch the job's lease guard in the same transaction."""
        record_key = self.record_key(ckpt.job_id, ckpt.id)
        value = json.dumps({"holder": holder, "ttl_s": ttl_s, "acquired_at": now}).encode()
        result = await self._store.txn(
            [mod_revision_is(record_key, expected_revision)],
            [Put(self.lease_key(ckpt.job_id, ckpt.id, lease_id), value, lease=lease_id),
             Put(self.lease_guard_key(ckpt.job_id), f"{lease_id:x}".encode())])
        return result.succeeded
