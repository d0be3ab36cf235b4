"""A job's attempt fence (`checkpoint-attempts/<job_id>`) is bounded: GC drops it in the transaction that purges
the job's last checkpoint record, and a Begin racing that purge keeps it (or writes it anew), so a record never
exists without its fence and a stale attempt is refused as before. On the real etcd and on the in-memory twin;
races are made deterministic by a hook that runs the other side's write just before a transaction."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from trainyard_checkpoint.domain import BeginRequest, Checkpoint, CheckpointState, Shard
from trainyard_checkpoint.domain.gc import ActionKind, GcTiming
from trainyard_checkpoint.domain.retention import RetentionPolicy
from trainyard_checkpoint.gc import GarbageCollector
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

JOB = "job-fence"
GRACE_S, TOMBSTONE_S = 100.0, 500.0


class HookedStore:
    """A store whose next transaction is preceded by `before_next_txn` (run once)."""

    def __init__(self, inner: Store) -> None:
        self._inner = inner
        self.before_next_txn: Callable[[], Awaitable[Any]] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def txn(self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()) -> TxnResult:
        hook, self.before_next_txn = self.before_next_txn, None
        if hook is not None:
            await hook()
        return await self._inner.txn(compares, success, failure)


@dataclass
class Service:
    """Two replicas over one store and storage: `racing`'s transactions can be preceded by `other`'s work."""

    racing: CheckpointManager
    other: CheckpointManager
    hook: HookedStore
    store: Store
    clock: ManualClock

    def gc(self, manager: CheckpointManager) -> GarbageCollector:
        return GarbageCollector(manager, self.clock, GcTiming(grace_s=GRACE_S, abandon_writing_s=3600,
                                                              tombstone_retention_s=TOMBSTONE_S))

    async def fence(self) -> bytes | None:
        kv = await self.store.get(self.other.repo.attempt_key(JOB))
        return None if kv is None else kv.value

    async def records(self) -> list[Checkpoint]:
        return [r.checkpoint for r in await self.other.repo.list_stored(JOB)]


@pytest.fixture(params=["etcd", "memory"])
async def service(request: pytest.FixtureRequest, tmp_path: Path, key_prefix: str) -> AsyncIterator[Service]:
    store: Store = EtcdStore.from_options(request.getfixturevalue("etcd_options")) if request.param == "etcd" \
        else MemoryStore()
    storage = PosixStorage(tmp_path / "ckpt")
    storage.ensure_root()
    clock = ManualClock()
    prefix = key_prefix.rstrip("/")
    hooked = HookedStore(store)
    try:
        yield Service(racing=CheckpointManager(CheckpointRepository(hooked, prefix), storage, clock),
                      other=CheckpointManager(CheckpointRepository(store, prefix), storage, clock),
                      hook=hooked, store=store, clock=clock)
    finally:
        await store.close()


async def begin(manager: CheckpointManager, step: int, attempt: int) -> Checkpoint:
    return await manager.begin(BeginRequest(job_id=JOB, attempt=attempt, step=step, world_size=1, metadata={}))


async def write_shard(ckpt: Checkpoint) -> list[Shard]:
    data = f"attempt {ckpt.attempt} step {ckpt.step}".encode()
    (location_dir(ckpt.location) / "__0_0.distcp").write_bytes(data)
    return [Shard(rank=0, path="__0_0.distcp", size_bytes=len(data), checksum=checksum_of(data))]


async def tombstoned(service: Service, attempt: int, step: int) -> Checkpoint:
    """A checkpoint begun, aborted, and removed by GC: a DELETED record with no files, its tombstone's time
    starting now."""
    ckpt = await begin(service.other, step, attempt)
    await service.other.abort(ckpt.id, "worker died")
    service.clock.advance(GRACE_S)
    done = await service.gc(service.other).run_once()
    assert (ActionKind.REMOVE_ABORTED, ckpt.id) in [(a.kind, a.checkpoint_id) for a in done]
    return ckpt


async def test_the_fence_goes_with_the_last_record_and_not_before(service: Service) -> None:
    repo = service.other.repo
    await repo.record_team(JOB, "team-a")
    await repo.set_retention(JOB, RetentionPolicy(keep_last=2))
    await service.store.put(repo.lease_guard_key(JOB), b"1")  # what a restore lease leaves behind
    first = await tombstoned(service, attempt=2, step=10)
    service.clock.advance(300)
    second = await tombstoned(service, attempt=3, step=20)
    assert await service.fence() == b"3"
    gc = service.gc(service.other)

    # Deleted at 100 and 500 (each GRACE_S after its abort): at 600 the first tombstone is due, the second not.
    service.clock.advance(TOMBSTONE_S - 300 - GRACE_S)
    assert [(a.kind, a.checkpoint_id) for a in await gc.run_once()] == [(ActionKind.PURGE_TOMBSTONE, first.id)]
    assert [r.id for r in await service.records()] == [second.id]
    assert await service.fence() == b"3", "a record is left: the fence stays"
    assert await repo.job_team(JOB) == "team-a" and await repo.retention(JOB) == RetentionPolicy(keep_last=2)

    service.clock.advance(400)
    assert [(a.kind, a.checkpoint_id) for a in await gc.run_once()] == [(ActionKind.PURGE_TOMBSTONE, second.id)]
    assert await service.records() == []
    assert await service.fence() is None, "the job's last record took its fence with it"
    left = [k for k in (repo.team_key(JOB), repo.lease_guard_key(JOB), repo.retention_key(JOB), repo.latest_key(JOB))
            if await service.store.get(k) is not None]
    assert left == [], "and every other key of the job"

    # The job saves again: the Begin writes the fence anew, and it fences as before.
    again = await begin(service.other, 30, attempt=4)
    assert await service.fence() == b"4"
    with pytest.raises(FailedPrecondition, match=f"attempt 3 of job {JOB} is stale: attempt 4"):
        await begin(service.other, 40, attempt=3)
    committed = await service.other.commit(again.id, await write_shard(again))
    assert committed.state is CheckpointState.COMMITTED


async def test_a_job_with_a_committed_checkpoint_keeps_its_fence(service: Service) -> None:
    """Delete refuses the latest and GC keeps it: a job that has saved keeps a record, and so its fence."""
    kept = await begin(service.other, 10, attempt=1)
    await service.other.commit(kept.id, await write_shard(kept))
    await tombstoned(service, attempt=1, step=20)
    service.clock.advance(TOMBSTONE_S)
    gc = service.gc(service.other)
    assert [a.kind for a in await gc.run_once()] == [ActionKind.PURGE_TOMBSTONE]
    assert [r.id for r in await service.records()] == [kept.id]
    assert await service.fence() == b"1"


async def test_a_begin_landing_before_the_last_purge_keeps_the_fence(service: Service) -> None:
    """GC read the fence and listed one record; a Begin of the same attempt (which leaves the fence's value as it
    was) lands before the purge's transaction: the fence's revision moved, so the record is purged alone."""
    old = await tombstoned(service, attempt=2, step=10)
    service.clock.advance(TOMBSTONE_S)
    begun: list[Checkpoint] = []

    async def begin_elsewhere() -> None:
        begun.append(await begin(service.other, 20, attempt=2))

    async def after_the_lock() -> None:  # the GC lock is the pass's first transaction
        service.hook.before_next_txn = begin_elsewhere

    service.hook.before_next_txn = after_the_lock
    done = await service.gc(service.racing).run_once()
    assert [(a.kind, a.checkpoint_id) for a in done] == [(ActionKind.PURGE_TOMBSTONE, old.id)]
    assert [r.id for r in await service.records()] == [begun[0].id]
    assert await service.fence() == b"2", "the new record keeps its fence"
    # ... which still fences: an older attempt can neither begin nor commit.
    with pytest.raises(FailedPrecondition, match=rf"attempt 1 of job {JOB} is stale"):
        await begin(service.other, 30, attempt=1)
    committed = await service.other.commit(begun[0].id, await write_shard(begun[0]))
    assert committed.state is CheckpointState.COMMITTED


async def test_a_begin_in_flight_when_the_fence_goes_writes_it_again(service: Service) -> None:
    """The Begin read the fence; the last record's purge drops it before the Begin's transaction: that
    transaction fails on the fence, and the Begin decides again from "no fence" and writes it at its attempt."""
    await tombstoned(service, attempt=2, step=10)
    service.clock.advance(TOMBSTONE_S)
    gc = service.gc(service.other)

    async def purge_elsewhere() -> None:
        assert [a.kind for a in await gc.run_once()] == [ActionKind.PURGE_TOMBSTONE]
        assert await service.fence() is None

    service.hook.before_next_txn = purge_elsewhere
    ckpt = await begin(service.racing, 20, attempt=3)
    assert [r.id for r in await service.records()] == [ckpt.id]
    assert await service.fence() == b"3"
    with pytest.raises(FailedPrecondition, match=rf"attempt 2 of job {JOB} is stale: attempt 3"):
        await begin(service.other, 30, attempt=2)


async def test_a_stale_commit_is_refused_while_the_fence_lives_and_then_nothing_is_left_to_commit(
        service: Service) -> None:
    """An old attempt's WRITING checkpoint is a record, so its fence cannot go while the old attempt could
    commit it; once GC has aborted and purged it, there is nothing left that the old attempt could commit."""
    stale = await begin(service.other, 10, attempt=1)
    stale_shards = await write_shard(stale)
    newer = await begin(service.other, 20, attempt=2)
    with pytest.raises(FailedPrecondition, match=rf"was not committed: attempt 1 of job {JOB} is stale"):
        await service.other.commit(stale.id, stale_shards)
    for ckpt in (stale, newer):
        await service.other.abort(ckpt.id, "job cancelled")
    gc = service.gc(service.other)
    service.clock.advance(GRACE_S)
    await gc.run_once()
    assert await service.fence() == b"2", "DELETED records are records: the fence stays"
    service.clock.advance(TOMBSTONE_S)
    await gc.run_once()
    assert await service.records() == [] and await service.fence() is None
    with pytest.raises(NotFound):
        await service.other.commit(stale.id, stale_shards)
    assert not location_dir(stale.location).exists()
