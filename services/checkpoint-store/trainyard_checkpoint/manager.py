"""The checkpoint lifecycle: load → pure decision (domain) → compare-and-swap write (repository).

Each operation reads what it needs, asks the domain what the new record is, and writes it with a
transaction guarded by the revisions it read. When a concurrent change wins, it reads again and decides
again (bounded; Conflict after that). Storage is looked at before the transaction, never inside it.
The commit order (verify, manifest, transaction) is documented in `domain/checkpoint.py`.

Idempotency: Begin is not (each call reserves a new id); Commit, Abort, Delete, Tag and Untag are. A reader's
report of damage is checked and recorded by damage.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from trainyard_core.clock import Clock
from trainyard_core.errors import FailedPrecondition, NotFound, Unavailable
from trainyard_core.ids import new_id
from trainyard_core.logs import log_context

from . import domain, metrics
from .damage import MAX_PROBLEMS_SHOWN, DamageReport, DamageReports, load, retry
from .domain import Checkpoint, CheckpointState, RetentionPolicy, Shard
from .domain.validation import (
    CHECKPOINT_ID_PREFIX,
    BeginRequest,
    page_size,
    validate_begin,
    validate_checkpoint_id,
    validate_job_id,
    validate_page_token,
    validate_shards,
    validate_tag,
)
from .manifest import manifest_bytes
from .repository import CheckpointRepository, LeaseState, StoredCheckpoint
from .storage import CheckpointStorage
from .verify import ShardVerifier

log = logging.getLogger(__name__)
T = TypeVar("T")
__all__ = ["MAX_PROBLEMS_SHOWN", "CheckpointManager", "DamageReport", "Page"]



@dataclass(frozen=True, slots=True)
class Page:
    checkpoints: list[Checkpoint]
    next_page_token: str


class CheckpointManager:
    def __init__(self, repo: CheckpointRepository, storage: CheckpointStorage, clock: Clock, *,
                 verifier: ShardVerifier | None = None, max_attempts: int = 16) -> None:
        self._repo = repo
        self._storage = storage
        self._clock = clock
        self._verifier = verifier or ShardVerifier(storage)
        self._max_attempts = max_attempts
        self._damage = DamageReports(repo, self._verifier, clock, max_attempts)

    @property
    def repo(self) -> CheckpointRepository:
        return self._repo

    @property
    def storage(self) -> CheckpointStorage:
        return self._storage

    def close(self) -> None:
        self._verifier.close()

    async def _load(self, checkpoint_id: str) -> StoredCheckpoint:
        return await load(self._repo, checkpoint_id)

    async def _retry(self, what: str, attempt: Callable[[], Awaitable[T | None]]) -> T:
        return await retry(what, attempt, self._max_attempts)

    # -- Begin --------------------------------------------------------------------------------------
    async def begin(self, req: BeginRequest) -> Checkpoint:
        """Reserve an id and a location (prepared in storage) for a new WRITING checkpoint.

        Refused (FailedPrecondition) when an attempt of the job newer than `req.attempt` has begun a
        checkpoint (see `domain.attempt_problem`), or when `req.step` is not above the job's latest
        committed step. The
        check reads the pointer without guarding it: a commit racing this Begin can only be of an
        older Begin, and the pointer only moves forward, so the new checkpoint is at worst one that
        never becomes latest.
        """
        validate_begin(req)
        latest = await self._latest_or_none(req.job_id)
        problem = domain.step_problem(req.step, latest)
        if problem is not None:
            raise FailedPrecondition(problem)
        if req.retention is not None and await self._repo.retention(req.job_id) != req.retention:
            await self._repo.set_retention(req.job_id, req.retention)

        # Whose the directory is where the storage keeps teams apart: recorded by the access check of this very
        # call when a worker's credential makes it (access.py).
        team = await self._repo.job_team(req.job_id) or ""

        async def attempt() -> Checkpoint | None:
            fence = await self._repo.attempt_fence(req.job_id)
            stale = domain.attempt_problem(req.job_id, req.attempt, fence.attempt)
            if stale is not None:
                raise FailedPrecondition(stale)
            now = self._clock.now()
            checkpoint_id = new_id(CHECKPOINT_ID_PREFIX, now)
            location = self._storage.location_for(req.job_id, checkpoint_id)
            ckpt = domain.new_checkpoint(
                checkpoint_id=checkpoint_id, job_id=req.job_id, attempt=req.attempt, step=req.step,
                world_size=req.world_size, location=location, metadata=req.metadata, now=now,
                lineage=req.lineage)
            # The directory first: if the store write then fails, an empty directory is all that is
            # left (GC removes it as an orphan), while the other order could leave a WRITING record
            # with nowhere to write.
            await self._storage.prepare(location, team)
            return ckpt if await self._repo.create(ckpt, fence) else None

        ckpt = await self._retry("begin", attempt)
        metrics.BEGUN.inc()
        with log_context(job_id=ckpt.job_id, checkpoint_id=ckpt.id):
            log.info("checkpoint begun", extra={"step": ckpt.step, "world_size": ckpt.world_size,
                                                "location": ckpt.location})
        return ckpt

    # -- Commit -------------------------------------------------------------------------------------
    async def _verify_storage(self, ckpt: Checkpoint, shards: Sequence[Shard]) -> None:
        problems = await self._verifier.problems(ckpt.location, shards)
        if problems:
            shown = "; ".join(problems[:MAX_PROBLEMS_SHOWN])
            more = len(problems) - MAX_PROBLEMS_SHOWN
            raise FailedPrecondition(f"checkpoint {ckpt.id} was not committed (it stays WRITING: rewrite the "
                                     f"shards and commit again, or abort it): {shown}"
                                     + (f"; and {more} more" if more > 0 else ""))

    async def commit(self, checkpoint_id: str, shards: Sequence[Shard]) -> Checkpoint:
        """Verify every declared shard in storage, write the manifest, then record the shards and move
        the job's latest pointer (forward only) in one transaction. Nothing is written when a shard is
        missing, truncated or corrupt."""
        validate_checkpoint_id(checkpoint_id)
        stored = await self._load(checkpoint_id)
        validate_shards(shards, stored.checkpoint.world_size, verifiable=self._verifier.mode == "checksum")
        if stored.checkpoint.state is not CheckpointState.WRITING:
            # Either the idempotent answer or the refusal; storage need not be looked at.
            return domain.commit(stored.checkpoint, shards, self._clock.now())
        try:
            return await self._commit_writing(stored, shards)
        except FailedPrecondition:
            metrics.COMMITS.labels("refused").inc()
            raise
        except Exception:
            metrics.COMMITS.labels("failed").inc()
            raise

    async def _commit_writing(self, stored: StoredCheckpoint, shards: Sequence[Shard]) -> Checkpoint:
        checkpoint_id = stored.checkpoint.id
        started = time.perf_counter()
        await self._verify_storage(stored.checkpoint, shards)
        # The manifest does not depend on the commit time, so a retried commit writes the same bytes.
        draft = domain.commit(stored.checkpoint, shards, self._clock.now())
        await self._storage.write_once(draft.location, domain.MANIFEST_NAME, manifest_bytes(draft))

        async def attempt() -> Checkpoint | None:
            nonlocal stored
            ckpt = stored.checkpoint
            committed = domain.commit(ckpt, shards, self._clock.now())
            if committed == ckpt:  # committed meanwhile by a retry of this same call
                return ckpt
            fence = await self._repo.attempt_fence(ckpt.job_id)
            stale = domain.attempt_problem(ckpt.job_id, ckpt.attempt, fence.attempt)
            if stale is not None:
                raise FailedPrecondition(f"checkpoint {ckpt.id} was not committed: {stale}")
            latest = await self._repo.latest_pointer(ckpt.job_id)
            latest_step = await self._step_of(ckpt.job_id, latest.checkpoint_id)
            move = domain.moves_latest(latest_step, committed.step)
            # The pointer only moves forward, so a commit that does not move it needs no guard on it:
            # a concurrent move can only take it further from this step.
            if await self._repo.update(committed, expected_revision=stored.mod_revision,
                                       latest_guard=latest if move else None, move_latest=move, fence=fence):
                with log_context(job_id=ckpt.job_id, checkpoint_id=ckpt.id):
                    log.info("checkpoint committed", extra={
                        "step": committed.step, "shards": len(committed.shards),
                        "total_bytes": committed.total_bytes, "moved_latest": move,
                        "verified": self._verifier.mode})
                _committed(committed, time.perf_counter() - started)
                return committed
            stored = await self._load(checkpoint_id)
            return None

        return await self._retry("commit", attempt)

    async def _step_of(self, job_id: str, checkpoint_id: str | None) -> int | None:
        if checkpoint_id is None:
            return None
        stored = await self._repo.load_in_job(job_id, checkpoint_id)
        return None if stored is None else stored.checkpoint.step

    # -- Abort --------------------------------------------------------------------------------------
    async def abort(self, checkpoint_id: str, reason: str) -> Checkpoint:
        """WRITING → ABORTED; storage is left alone (workers may still be writing)."""
        validate_checkpoint_id(checkpoint_id)

        async def attempt() -> Checkpoint | None:
            stored = await self._load(checkpoint_id)
            return await self.abort_if_unchanged(stored, reason)

        return await self._retry("abort", attempt)

    async def abort_if_unchanged(self, stored: StoredCheckpoint, reason: str) -> Checkpoint | None:
        """Abort as read at `stored.mod_revision`; None when the record changed since (decide again)."""
        ckpt = stored.checkpoint
        aborted = domain.abort(ckpt, reason, self._clock.now())
        if aborted == ckpt:
            return ckpt
        if not await self._repo.update(aborted, expected_revision=stored.mod_revision):
            return None
        metrics.ABORTED.inc()
        with log_context(job_id=ckpt.job_id, checkpoint_id=ckpt.id):
            log.info("checkpoint aborted", extra={"reason": aborted.abort_reason})
        return aborted

    # -- Delete -------------------------------------------------------------------------------------
    async def delete(self, checkpoint_id: str) -> Checkpoint:
        """Mark DELETED, then remove the files. A retry after a failed removal finishes it. Refused for
        the latest checkpoint, a tagged one and one under a restore lease."""
        validate_checkpoint_id(checkpoint_id)

        async def attempt() -> Checkpoint | None:
            stored = await self._load(checkpoint_id)
            leases = await self._repo.lease_state(stored.checkpoint.job_id)
            return await self.delete_if_unchanged(stored, leases)

        deleted = await self._retry("delete", attempt)
        await self._storage.remove(deleted.location)
        with log_context(job_id=deleted.job_id, checkpoint_id=deleted.id):
            log.info("checkpoint deleted", extra={"location": deleted.location})
        return deleted

    async def delete_if_unchanged(self, stored: StoredCheckpoint, leases: LeaseState) -> Checkpoint | None:
        """Mark DELETED as read at `stored.mod_revision` and with the leases in `leases`; None when the
        record changed or a lease was taken since (decide again). Does not touch storage."""
        ckpt = stored.checkpoint
        latest = await self._repo.latest_pointer(ckpt.job_id)
        deleted = domain.delete(ckpt, latest_id=latest.checkpoint_id, leases=leases.leased.get(ckpt.id, 0),
                                now=self._clock.now())
        if deleted == ckpt:
            return ckpt
        # No guard on the pointer is needed: it only ever moves onto a checkpoint in a transaction that
        # writes that checkpoint's record (Commit; ReportDamaged rewrites its fallback's record), and the
        # write below requires the record unchanged since it was read. Tags live in the record too.
        if not await self._repo.update(deleted, expected_revision=stored.mod_revision,
                                       lease_guard_revision=leases.guard_revision):
            return None
        return deleted

    # -- Damage -----------------------------------------------------------------------------------------
    async def report_damaged(self, checkpoint_id: str, shard_paths: Sequence[str], reason: str) -> DamageReport:
        """damage.DamageReports.report: a reader's report of a damaged checkpoint, checked here first."""
        return await self._damage.report(checkpoint_id, shard_paths, reason)

    # -- Tags ---------------------------------------------------------------------------------------
    async def tag(self, checkpoint_id: str, name: str) -> Checkpoint:
        return await self._retag(checkpoint_id, name, domain.tag, "tag")

    async def untag(self, checkpoint_id: str, name: str) -> Checkpoint:
        return await self._retag(checkpoint_id, name, domain.untag, "untag")

    async def _retag(self, checkpoint_id: str, name: str, change: Callable[[Checkpoint, str], Checkpoint],
                     what: str) -> Checkpoint:
        validate_checkpoint_id(checkpoint_id)
        validate_tag(name)

        async def attempt() -> Checkpoint | None:
            stored = await self._load(checkpoint_id)
            changed = change(stored.checkpoint, name)
            if changed == stored.checkpoint:
                return changed
            return changed if await self._repo.update(changed, expected_revision=stored.mod_revision) else None

        return await self._retry(what, attempt)

    # -- Retention ----------------------------------------------------------------------------------
    async def set_retention(self, job_id: str, policy: RetentionPolicy | None) -> RetentionPolicy | None:
        validate_job_id(job_id)
        if policy is not None:
            domain.validate_policy(policy)
        await self._repo.set_retention(job_id, policy)
        log.info("retention set", extra={"job_id": job_id, "policy": policy})
        return policy

    async def retention(self, job_id: str) -> RetentionPolicy | None:
        validate_job_id(job_id)
        return await self._repo.retention(job_id)

    # -- Reads --------------------------------------------------------------------------------------
    async def get(self, checkpoint_id: str) -> Checkpoint:
        validate_checkpoint_id(checkpoint_id)
        return (await self._load(checkpoint_id)).checkpoint

    async def _latest_or_none(self, job_id: str) -> Checkpoint | None:
        for _ in range(self._max_attempts):
            pointer = await self._repo.latest_pointer(job_id)
            if pointer.checkpoint_id is None:
                return None
            stored = await self._repo.load_in_job(job_id, pointer.checkpoint_id)
            # Between the two reads the pointer may have moved on and the old latest been deleted.
            if stored is not None and stored.checkpoint.state is CheckpointState.COMMITTED:
                return stored.checkpoint
        raise Unavailable(f"the latest pointer of job {job_id} keeps naming a checkpoint that is not "
                          "committed; the metadata store may be inconsistent")

    async def latest(self, job_id: str) -> Checkpoint:
        """The job's latest committed checkpoint; NotFound when it has none."""
        validate_job_id(job_id)
        latest = await self._latest_or_none(job_id)
        if latest is None:
            raise NotFound(f"job {job_id} has no committed checkpoint")
        return latest

    async def list(self, job_id: str, requested_page_size: int, page_token: str) -> Page:
        """A job's checkpoints (every state) in creation order, one page at a time.

        Creation order is id order: ids start with the creation time in milliseconds, so two checkpoints
        begun in the same millisecond are ordered by their random part. The page token is the last id of
        the previous page, so pages stay stable while new checkpoints are begun.
        """
        validate_job_id(job_id)
        size = page_size(requested_page_size)
        validate_page_token(page_token)
        items, more = await self._repo.list(job_id, after=page_token or None, limit=size)
        return Page(items, items[-1].id if more and items else "")


def _committed(ckpt: Checkpoint, work_s: float) -> None:
    """A checkpoint became COMMITTED: its save (Begin to Commit, on the service's clock), its size, and the
    Commit's own work."""
    metrics.COMMITS.labels("committed").inc()
    metrics.COMMIT_SECONDS.observe(work_s)
    if ckpt.committed_at is not None:
        metrics.SAVE_SECONDS.observe(max(0.0, ckpt.committed_at - ckpt.created_at))
    metrics.SAVED_BYTES.inc(ckpt.total_bytes)
    metrics.SIZE_BYTES.observe(ckpt.total_bytes)
