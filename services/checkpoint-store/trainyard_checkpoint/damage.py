"""A reader's report that a committed checkpoint is damaged, checked by the service before it believes it.

Separate from the lifecycle (manager.py: begin, commit, abort, delete, tags): a report is the one operation
that reads storage to decide (the shards' sizes and checksums), and the one that may move the job's latest
pointer back to an older checkpoint. `load` and `retry` are the read and the compare-and-swap loop every
operation of the checkpoint-store uses.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from trainyard_core.clock import Clock
from trainyard_core.errors import Conflict, FailedPrecondition, InvalidArgument, NotFound
from trainyard_core.logs import log_context

from . import domain, metrics
from .domain import Checkpoint, CheckpointState
from .domain.validation import validate_checkpoint_id, validate_shard_paths
from .repository import CheckpointRepository, StoredCheckpoint
from .verify import ShardVerifier

log = logging.getLogger(__name__)
T = TypeVar("T")

# Problems named in one commit error or damage note (the rest are counted, or left out).
MAX_PROBLEMS_SHOWN = 10


@dataclass(frozen=True, slots=True)
class DamageReport:
    """The checkpoint as marked, and the job's latest checkpoint id afterwards (None: it has none)."""

    checkpoint: Checkpoint
    latest_id: str | None


async def load(repo: CheckpointRepository, checkpoint_id: str) -> StoredCheckpoint:
    """The checkpoint's record; NotFound when there is none."""
    stored = await repo.load(checkpoint_id)
    if stored is None:
        raise NotFound(f"checkpoint {checkpoint_id} not found")
    return stored


async def retry(what: str, attempt: Callable[[], Awaitable[T | None]], max_attempts: int) -> T:
    """Run `attempt` until it returns a result (None means: a compare-and-swap lost, go again)."""
    for _ in range(max_attempts):
        result = await attempt()
        if result is not None:
            return result
    raise Conflict(f"{what} lost {max_attempts} concurrent updates in a row; retry")


class DamageReports:
    def __init__(self, repo: CheckpointRepository, verifier: ShardVerifier, clock: Clock, max_attempts: int) -> None:
        self._repo = repo
        self._verifier = verifier
        self._clock = clock
        self._max_attempts = max_attempts

    async def report(self, checkpoint_id: str, shard_paths: Sequence[str], reason: str) -> DamageReport:
        """A reader found a committed checkpoint damaged. The service checks by itself: it verifies the
        named shards (all of them when none is named) by size and checksum in storage. Confirmed → the
        record becomes DAMAGED and, when it was the job's latest, the pointer moves back to the newest
        remaining COMMITTED checkpoint (or is removed) in the same transaction, so the job can save the
        steps after it again. Not confirmed → FailedPrecondition: the files verify, so the reader's
        own path (its storage mount, its memory) is what to look at, and nothing changes."""
        validate_checkpoint_id(checkpoint_id)
        validate_shard_paths(shard_paths)
        stored = await load(self._repo, checkpoint_id)
        ckpt = stored.checkpoint
        if ckpt.state is CheckpointState.DAMAGED:
            pointer = await self._repo.latest_pointer(ckpt.job_id)
            return DamageReport(ckpt, pointer.checkpoint_id)
        if ckpt.state is not CheckpointState.COMMITTED:
            domain.mark_damaged(ckpt, reason, self._clock.now())  # raises: names the state
        named = set(shard_paths)
        unknown = named - {s.path for s in ckpt.shards}
        if unknown:
            raise InvalidArgument(f"checkpoint {ckpt.id} has no shard(s) {', '.join(sorted(unknown))}")
        checked = [s for s in ckpt.shards if s.path in named] if named else list(ckpt.shards)
        found = await self._verifier.problems(ckpt.location, checked, mode="checksum")
        if not found:
            raise FailedPrecondition(
                f"checkpoint {ckpt.id} was not marked damaged: its {len(checked)} shard(s) checked here "
                "have the recorded sizes and checksums in storage. The reader's own access to storage "
                "(mount, network, memory) is the suspect; reported: " + (reason or "no reason given"))
        damage = "; ".join(found[:MAX_PROBLEMS_SHOWN]) + (f" (reported: {reason})" if reason else "")

        async def attempt() -> DamageReport | None:
            nonlocal stored
            if stored.checkpoint.state is CheckpointState.DAMAGED:
                return DamageReport(stored.checkpoint, (await self._repo.latest_pointer(ckpt.job_id)).checkpoint_id)
            damaged = domain.mark_damaged(stored.checkpoint, damage, self._clock.now())
            pointer = await self._repo.latest_pointer(ckpt.job_id)
            move = pointer.checkpoint_id == ckpt.id
            fallback: StoredCheckpoint | None = None
            if move:
                records = await self._repo.list_stored(ckpt.job_id)
                best = domain.fallback_latest((r.checkpoint for r in records), excluded=ckpt.id)
                fallback = next((r for r in records if best is not None and r.checkpoint.id == best.id), None)
            if await self._repo.mark_damaged(damaged, expected_revision=stored.mod_revision, latest_guard=pointer,
                                             fallback=fallback, move_latest=move):
                latest_id = (fallback.checkpoint.id if fallback else None) if move else pointer.checkpoint_id
                metrics.DAMAGED.inc()
                with log_context(job_id=ckpt.job_id, checkpoint_id=ckpt.id):
                    log.warning("checkpoint marked damaged", extra={
                        "step": ckpt.step, "damage": damage, "was_latest": move, "latest": latest_id})
                return DamageReport(damaged, latest_id)
            stored = await load(self._repo, checkpoint_id)
            return None

        return await retry("report damaged", attempt, self._max_attempts)
