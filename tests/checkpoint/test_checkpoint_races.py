"""Compare-and-swap races in the checkpoint lifecycle, made deterministic: a hook runs another replica's
write just before this one's transaction, so the race is lost every time (no timing luck involved).
Runs on the real etcd and on the in-memory twin."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from trainyard_checkpoint.domain import BeginRequest, Checkpoint, CheckpointState, RetentionPolicy, Shard
from trainyard_checkpoint.domain.gc import ActionKind, GcTiming
from trainyard_checkpoint.gc import GarbageCollector
from trainyard_checkpoint.leases import RestoreLeases
from trainyard_checkpoint.manager import CheckpointManager
from trainyard_checkpoint.repository import CheckpointRepository
from trainyard_checkpoint.storage import PosixStorage
from trainyard_core.clock import ManualClock
from trainyard_core.errors import FailedPrecondition, NotFound
from trainyard_core.store import Compare, Store, TxnResult
from trainyard_core.store.api import Op
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.store.memory import MemoryStore

from .checkpoint_support import checksum_of, location_dir

JOB = "job-race"


class RacingStore:
    """A store whose next transaction is preceded by `before_next_txn` (run once)."""

    def __init__(self, inner: Store) -> None:
        self._inner = inner
        self.before_next_txn: Callable[[], Awaitable[Any]] | None = None
        self.txns = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def txn(self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()) -> TxnResult:
        hook, self.before_next_txn = self.before_next_txn, None
        if hook is not None:
            await hook()
        self.txns += 1
        return await self._inner.txn(compares, success, failure)


@dataclass
class Replicas:
    """Two service replicas over one store and one storage root; `racing` loses races on demand."""

    racing: CheckpointManager
    other: CheckpointManager
    hook: RacingStore
    clock: ManualClock


@pytest.fixture(params=["etcd", "memory"])
async def replicas(request: pytest.FixtureRequest, tmp_path: Path, key_prefix: str) -> AsyncIterator[Replicas]:
    store: Store = EtcdStore.from_options(request.getfixturevalue("etcd_options")) if request.param == "etcd" \
        else MemoryStore()
    storage = PosixStorage(tmp_path / "ckpt")
    storage.ensure_root()
    clock = ManualClock()
    prefix = key_prefix.rstrip("/")
    racing_store = RacingStore(store)
    try:
        yield Replicas(
            racing=CheckpointManager(CheckpointRepository(racing_store, prefix), storage, clock),
            other=CheckpointManager(CheckpointRepository(store, prefix), storage, clock),
            hook=racing_store, clock=clock)
    finally:
        await store.close()


async def begin_and_write(manager: CheckpointManager, step: int, world_size: int = 2) -> tuple[Checkpoint, list[Shard]]:
    ckpt = await manager.begin(BeginRequest(job_id=JOB, attempt=0, step=step, world_size=world_size, metadata={}))
    directory = location_dir(ckpt.location)
    shards = []
    for rank in range(world_size):
        data = f"rank {rank} step {step}".encode()
        (directory / f"__{rank}_0.distcp").write_bytes(data)
        shards.append(Shard(rank=rank, path=f"__{rank}_0.distcp", size_bytes=len(data), checksum=checksum_of(data)))
    return ckpt, shards


@pytest.mark.parametrize(("mine", "theirs", "latest_is"), [
    (100, 200, "theirs"),  # a newer step committed meanwhile: mine must not move latest back
    (300, 200, "mine"),  # an older step committed meanwhile: mine still moves latest forward
])
async def test_commit_that_loses_the_pointer_race_decides_again(
        replicas: Replicas, mine: int, theirs: int, latest_is: str) -> None:
    a, a_shards = await begin_and_write(replicas.other, mine)
    b, b_shards = await begin_and_write(replicas.other, theirs)
    replicas.hook.before_next_txn = lambda: replicas.other.commit(b.id, b_shards)
    before = replicas.hook.txns

    committed = await replicas.racing.commit(a.id, a_shards)

    assert committed.state is CheckpointState.COMMITTED
    assert replicas.hook.txns - before == 2, "the first transaction lost the race and was decided again"
    latest = await replicas.other.latest(JOB)
    assert latest.id == (a.id if latest_is == "mine" else b.id)


async def test_duplicate_commit_racing_itself_returns_the_committed_record(replicas: Replicas) -> None:
    a, shards = await begin_and_write(replicas.other, 10)
    winner: list[Checkpoint] = []

    async def commit_elsewhere() -> None:
        winner.append(await replicas.other.commit(a.id, list(reversed(shards))))

    replicas.hook.before_next_txn = commit_elsewhere
    result = await replicas.racing.commit(a.id, shards)
    assert result == winner[0]
    assert (await replicas.other.latest(JOB)).id == a.id


async def test_abort_winning_over_commit_leaves_nothing_committed(replicas: Replicas) -> None:
    a, shards = await begin_and_write(replicas.other, 10)
    replicas.hook.before_next_txn = lambda: replicas.other.abort(a.id, "job cancelled")
    with pytest.raises(FailedPrecondition, match="ABORTED"):
        await replicas.racing.commit(a.id, shards)
    assert (await replicas.other.get(a.id)).state is CheckpointState.ABORTED
    assert (await replicas.other.list(JOB, 0, "")).checkpoints[0].shards == ()


async def test_delete_racing_a_commit_that_makes_it_latest_is_impossible_by_construction(replicas: Replicas) -> None:
    # The pointer only moves onto a checkpoint in the transaction that commits it; a COMMITTED one
    # that is not latest can therefore be deleted without guarding the pointer, even while others commit.
    old, old_shards = await begin_and_write(replicas.other, 1)
    await replicas.other.commit(old.id, old_shards)
    newer, newer_shards = await begin_and_write(replicas.other, 2)
    await replicas.other.commit(newer.id, newer_shards)
    newest, newest_shards = await begin_and_write(replicas.other, 3)
    replicas.hook.before_next_txn = lambda: replicas.other.commit(newest.id, newest_shards)
    deleted = await replicas.racing.delete(old.id)
    assert deleted.state is CheckpointState.DELETED
    assert (await replicas.other.latest(JOB)).id == newest.id
    assert not location_dir(old.location).exists()


async def test_many_concurrent_commits_leave_latest_at_the_highest_step(replicas: Replicas) -> None:
    steps = list(range(0, 1200, 100))
    random.Random(7).shuffle(steps)
    saves = [await begin_and_write(replicas.other, step) for step in steps]
    managers = [replicas.racing, replicas.other]
    results = await asyncio.gather(*(managers[i % 2].commit(c.id, s) for i, (c, s) in enumerate(saves)))
    assert all(r.state is CheckpointState.COMMITTED for r in results)
    assert (await replicas.other.latest(JOB)).step == max(steps)


def leases_of(manager: CheckpointManager, clock: ManualClock) -> RestoreLeases:
    return RestoreLeases(manager.repo, clock, max_ttl_s=3600)


async def test_delete_racing_a_restore_lease_loses(replicas: Replicas) -> None:
    old, old_shards = await begin_and_write(replicas.other, 1)
    await replicas.other.commit(old.id, old_shards)
    newer, newer_shards = await begin_and_write(replicas.other, 2)
    await replicas.other.commit(newer.id, newer_shards)
    leases = leases_of(replicas.other, replicas.clock)
    replicas.hook.before_next_txn = lambda: leases.acquire(old.id, 60, "restorer")
    with pytest.raises(FailedPrecondition, match="being restored"):
        await replicas.racing.delete(old.id)
    assert (await replicas.other.get(old.id)).state is CheckpointState.COMMITTED
    assert location_dir(old.location).is_dir()


@pytest.mark.parametrize("protect", ["lease", "tag"])
async def test_gc_delete_racing_a_lease_or_a_tag_loses(replicas: Replicas, protect: str) -> None:
    old, old_shards = await begin_and_write(replicas.other, 1)
    await replicas.other.commit(old.id, old_shards)
    newer, newer_shards = await begin_and_write(replicas.other, 2)
    await replicas.other.commit(newer.id, newer_shards)
    await replicas.other.set_retention(JOB, RetentionPolicy(keep_last=1))
    gc = GarbageCollector(replicas.racing, replicas.clock, GcTiming(3600, 3600, 3600))
    leases = leases_of(replicas.other, replicas.clock)

    async def protect_it() -> None:
        if protect == "lease":
            await leases.acquire(old.id, 60, "restorer")
        else:
            await replicas.other.tag(old.id, "keep")

    async def after_the_lock() -> None:  # the GC lock is the pass's first transaction
        replicas.hook.before_next_txn = protect_it

    replicas.hook.before_next_txn = after_the_lock
    assert await gc.run_once() == [], "the deletion decided before the lease/tag was taken must fail"
    assert (await replicas.other.get(old.id)).state is CheckpointState.COMMITTED
    assert location_dir(old.location).is_dir()
    # The next pass sees the protection and plans nothing.
    assert await gc.run_once(dry_run=True) == []


async def test_gc_applies_the_plan_it_made(replicas: Replicas) -> None:
    old, old_shards = await begin_and_write(replicas.other, 1)
    await replicas.other.commit(old.id, old_shards)
    newer, newer_shards = await begin_and_write(replicas.other, 2)
    await replicas.other.commit(newer.id, newer_shards)
    await replicas.other.set_retention(JOB, RetentionPolicy(keep_last=1))
    gc = GarbageCollector(replicas.racing, replicas.clock, GcTiming(3600, 3600, 3600))
    done = await gc.run_once()
    assert [(a.kind, a.checkpoint_id) for a in done] == [(ActionKind.DELETE_BY_RETENTION, old.id)]
    assert not location_dir(old.location).exists()


async def committed_at(manager: CheckpointManager, step: int) -> Checkpoint:
    ckpt, shards = await begin_and_write(manager, step)
    return await manager.commit(ckpt.id, shards)


def damage(ckpt: Checkpoint) -> None:
    (location_dir(ckpt.location) / "__1_0.distcp").unlink()


async def test_damaged_latest_racing_a_newer_commit_leaves_the_newer_one_latest(replicas: Replicas) -> None:
    await committed_at(replicas.other, 1)
    bad = await committed_at(replicas.other, 2)
    damage(bad)
    newer, newer_shards = await begin_and_write(replicas.other, 3)
    replicas.hook.before_next_txn = lambda: replicas.other.commit(newer.id, newer_shards)

    report = await replicas.racing.report_damaged(bad.id, ["__1_0.distcp"], "missing")

    assert report.checkpoint.state is CheckpointState.DAMAGED and "missing" in report.checkpoint.damage
    assert report.latest_id == newer.id, "the pointer moved on meanwhile: it is not moved back"
    assert (await replicas.other.latest(JOB)).id == newer.id


async def test_damaged_latest_racing_the_deletion_of_its_fallback_falls_back_further(replicas: Replicas) -> None:
    oldest = await committed_at(replicas.other, 1)
    fallback = await committed_at(replicas.other, 2)
    bad = await committed_at(replicas.other, 3)
    damage(bad)
    replicas.hook.before_next_txn = lambda: replicas.other.delete(fallback.id)

    report = await replicas.racing.report_damaged(bad.id, [], "")

    assert report.latest_id == oldest.id
    assert (await replicas.other.latest(JOB)).id == oldest.id
    # And the job can save the steps after it again.
    again = await committed_at(replicas.other, 2)
    assert (await replicas.other.latest(JOB)).id == again.id


async def test_deleting_the_fallback_racing_a_damage_report_is_refused(replicas: Replicas) -> None:
    await committed_at(replicas.other, 1)
    fallback = await committed_at(replicas.other, 2)
    bad = await committed_at(replicas.other, 3)
    damage(bad)
    # The delete reads the pointer (naming `bad`), then the report moves it to `fallback` before the
    # delete's transaction: the delete must decide again and refuse.
    replicas.hook.before_next_txn = lambda: replicas.other.report_damaged(bad.id, ["__1_0.distcp"], "")

    with pytest.raises(FailedPrecondition, match="is the latest checkpoint"):
        await replicas.racing.delete(fallback.id)

    assert (await replicas.other.latest(JOB)).id == fallback.id
    assert (await replicas.other.get(fallback.id)).state is CheckpointState.COMMITTED


async def test_damage_on_the_only_checkpoint_clears_latest_and_a_report_it_cannot_confirm_is_refused(
        replicas: Replicas) -> None:
    only = await committed_at(replicas.other, 5)
    with pytest.raises(FailedPrecondition, match="not marked damaged"):
        await replicas.racing.report_damaged(only.id, [], "reader saw zeros")
    assert (await replicas.other.get(only.id)).state is CheckpointState.COMMITTED
    damage(only)
    first = await replicas.racing.report_damaged(only.id, [], "")
    assert first.latest_id is None
    assert await replicas.other.report_damaged(only.id, [], "again") == first, "idempotent"
    assert (await replicas.other.list(JOB, 0, "")).checkpoints[0].state is CheckpointState.DAMAGED
    with pytest.raises(NotFound):
        await replicas.other.latest(JOB)
    await committed_at(replicas.other, 1)


async def test_gc_removes_a_damaged_checkpoint_after_the_grace(replicas: Replicas) -> None:
    good = await committed_at(replicas.other, 1)
    bad = await committed_at(replicas.other, 2)
    damage(bad)
    await replicas.other.report_damaged(bad.id, [], "")
    gc = GarbageCollector(replicas.racing, replicas.clock, GcTiming(3600, 3600, 3600))
    assert await gc.run_once() == [], "kept for inspection during the grace"
    replicas.clock.advance(3600)
    done = await gc.run_once()
    assert [(a.kind, a.checkpoint_id) for a in done] == [(ActionKind.REMOVE_DAMAGED, bad.id)]
    assert not location_dir(bad.location).exists() and location_dir(good.location).exists()
    assert (await replicas.other.get(bad.id)).state is CheckpointState.DELETED


async def begin_as(manager: CheckpointManager, step: int, attempt: int) -> tuple[Checkpoint, list[Shard]]:
    ckpt = await manager.begin(BeginRequest(job_id=JOB, attempt=attempt, step=step, world_size=1, metadata={}))
    data = f"attempt {attempt} step {step}".encode()
    (location_dir(ckpt.location) / "__0_0.distcp").write_bytes(data)
    return ckpt, [Shard(rank=0, path="__0_0.distcp", size_bytes=len(data), checksum=checksum_of(data))]


async def test_an_old_attempt_cannot_begin_or_commit_once_a_newer_one_began(replicas: Replicas) -> None:
    old, old_shards = await begin_as(replicas.other, 10, attempt=1)
    await begin_as(replicas.other, 20, attempt=2)
    with pytest.raises(FailedPrecondition, match="attempt 1 of job job-race is stale: attempt 2"):
        await begin_as(replicas.other, 30, attempt=1)
    with pytest.raises(FailedPrecondition, match="was not committed: attempt 1 of job job-race is stale"):
        await replicas.other.commit(old.id, old_shards)
    with pytest.raises(NotFound):
        await replicas.other.latest(JOB)


async def test_a_newer_attempt_beginning_just_before_an_old_commit_wins(replicas: Replicas) -> None:
    old, old_shards = await begin_as(replicas.other, 10, attempt=1)
    # The old attempt's commit reads the fence, then the restarted job's first Begin lands before the
    # commit's transaction: the transaction must fail on the fence and the commit be refused.
    replicas.hook.before_next_txn = lambda: begin_as(replicas.other, 10, attempt=2)
    with pytest.raises(FailedPrecondition, match="stale"):
        await replicas.racing.commit(old.id, old_shards)
    assert (await replicas.other.get(old.id)).state is CheckpointState.WRITING
    with pytest.raises(NotFound):
        await replicas.other.latest(JOB)
