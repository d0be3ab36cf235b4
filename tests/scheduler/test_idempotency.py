"""A submit's idempotency key, in the repository: bound to the request that first used it, per team; a key
written by an earlier version (the job id alone) still answers any retry."""

from __future__ import annotations

import asyncio

import pytest

from trainyard_core.errors import IdempotencyKeyReused
from trainyard_core.store.memory import MemoryStore
from trainyard_scheduler.state.keys import Keys
from trainyard_scheduler.state.repository import Repository

from .builders import make_job

KEYS = Keys("/t")


async def test_a_key_answers_its_own_request_and_refuses_another() -> None:
    repo = Repository(MemoryStore(), KEYS)
    _, created = await repo.create_job(make_job("job-a1"), "k-1", "digest-1")
    assert created
    again, created = await repo.create_job(make_job("job-a2"), "k-1", "digest-1")
    assert (again.id, created) == ("job-a1", False)
    with pytest.raises(IdempotencyKeyReused, match="'k-1' was used for another request \\(job job-a1"):
        await repo.create_job(make_job("job-a3"), "k-1", "digest-2")
    assert await repo.get_job("job-a3") is None, "the refused submit stored nothing"
    # Keys are per team: another team's k-1 is its own.
    other, created = await repo.create_job(make_job("job-b1", team="team-b"), "k-1", "digest-2")
    assert (other.id, created) == ("job-b1", True)


async def test_a_key_written_before_digests_answers_any_retry() -> None:
    store = MemoryStore()
    repo = Repository(store, KEYS)
    await repo.create_job(make_job("job-old"))
    await store.put(KEYS.idempotency("team-a", "legacy"), b"job-old")
    got, created = await repo.create_job(make_job("job-new"), "legacy", "any-digest")
    assert (got.id, created) == ("job-old", False)


async def test_a_create_leaves_its_revision_for_the_submit_answer_and_a_replay_does_not_move_it() -> None:
    repo = Repository(MemoryStore(), KEYS)
    job = make_job("job-r1")
    await repo.create_job(job, "key-r1", "digest")
    found = await repo.get_job(job.id)
    assert found is not None and repo.created_revision == found[1], "the create's own revision, read back"
    await repo.store.put("/elsewhere", b"x")  # a later write that is not a job create
    again = make_job("job-r2")
    stored, created = await repo.create_job(again, "key-r1", "digest")
    assert (stored.id, created) == (job.id, False) and repo.created_revision == found[1]


async def test_concurrent_submits_with_one_key_create_one_job() -> None:
    """Creates share etcd transactions (store/batch.py): two writes of one key never share one, so of twenty
    concurrent retries of a submit exactly one creates the job and the others answer it."""
    repo = Repository(MemoryStore(), KEYS)
    results = await asyncio.gather(*(repo.create_job(make_job(f"job-r{i}"), "k-retry", "d") for i in range(20)))
    created = [job.id for job, new in results if new]
    assert len(created) == 1
    assert {job.id for job, _ in results} == set(created)
    stored = [await repo.get_job(f"job-r{i}") for i in range(20)]
    assert sum(found is not None for found in stored) == 1


async def test_concurrent_submits_that_find_the_hours_lease_gone_share_one_new_lease() -> None:
    store = MemoryStore()
    repo = Repository(store, KEYS)
    await repo.create_job(make_job("job-l0"), "k-l0", "d")
    (old,) = repo._idem_leases.values()
    await store.revoke_lease(old)  # takes k-l0 with it, as etcd would
    results = await asyncio.gather(*(repo.create_job(make_job(f"job-l{i}"), f"k-l{i}", "d") for i in range(1, 11)))
    assert all(created for _, created in results)
    (new,) = repo._idem_leases.values()
    assert new != old
    for i in range(1, 11):
        kv = await store.get(KEYS.idempotency("team-a", f"k-l{i}"))
        assert kv is not None and kv.lease == new
