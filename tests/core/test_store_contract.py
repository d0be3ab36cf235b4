"""One contract, two implementations: the etcd store (real etcd) and its in-memory twin."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from trainyard_core.clock import ManualClock
from trainyard_core.errors import FailedPrecondition, Unavailable
from trainyard_core.store import Delete, Put, Store, absent, exists, mod_revision_is, value_is
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.store.memory import MemoryStore


@pytest.fixture(params=["memory", "etcd"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    if request.param == "memory":
        yield MemoryStore()
    else:
        s = EtcdStore.from_options(request.getfixturevalue("etcd_options"))
        yield s
        await s.close()


async def test_put_get_and_revisions(store: Store, key_prefix: str) -> None:
    k = key_prefix + "a"
    assert await store.get(k) is None
    r1 = await store.put(k, b"1")
    kv = await store.get(k)
    assert kv is not None and kv.value == b"1" and kv.mod_revision == r1 and kv.version == 1
    r2 = await store.put(k, b"2")
    kv2 = await store.get(k)
    assert r2 > r1 and kv2 is not None and kv2.version == 2 and kv2.create_revision == kv.create_revision


async def test_txn_is_all_or_nothing(store: Store, key_prefix: str) -> None:
    a, b = key_prefix + "a", key_prefix + "b"
    await store.put(a, b"x")
    res = await store.txn([absent(a)], [Put(b, b"never")], [Put(b, b"failure-branch")])
    assert not res.succeeded
    got = await store.get(b)
    assert got is not None and got.value == b"failure-branch"
    kv = await store.get(a)
    assert kv is not None
    res = await store.txn([mod_revision_is(a, kv.mod_revision), exists(b)], [Put(a, b"y"), Delete(b)])
    assert res.succeeded
    assert await store.get(b) is None
    a_now = await store.get(a)
    assert a_now is not None and a_now.value == b"y"
    # A stale revision loses the compare-and-swap and changes nothing.
    res = await store.txn([mod_revision_is(a, kv.mod_revision)], [Put(a, b"z")])
    assert not res.succeeded
    a_after = await store.get(a)
    assert a_after is not None and a_after.value == b"y"
    assert (await store.txn([value_is(a, b"y")], [])).succeeded


async def test_range_pages_in_key_order(store: Store, key_prefix: str) -> None:
    for i in range(7):
        await store.put(f"{key_prefix}k{i:02d}", str(i).encode())
    await store.put(key_prefix.rstrip("/") + "0/outside", b"no")  # shares no prefix with key_prefix
    seen: list[str] = []
    after: str | None = None
    while True:
        page = await store.range(key_prefix, start_after=after, limit=3)
        seen += [kv.key for kv in page.kvs]
        if not page.more:
            break
        after = page.kvs[-1].key
    assert seen == [f"{key_prefix}k{i:02d}" for i in range(7)]
    everything = await store.range(key_prefix)
    assert len(everything.kvs) == 7 and not everything.more


async def test_range_pages_descending(store: Store, key_prefix: str) -> None:
    for i in range(7):
        await store.put(f"{key_prefix}k{i:02d}", str(i).encode())
    await store.put(key_prefix.rstrip("/") + "0/outside", b"no")  # sorts after every key under key_prefix
    await store.put(key_prefix.rstrip("/") + "-before", b"no")  # sorts before them
    pages: list[list[str]] = []
    after: str | None = None
    while True:
        page = await store.range(key_prefix, start_after=after, limit=3, descending=True)
        pages.append([kv.key for kv in page.kvs])
        if not page.more:
            break
        after = page.kvs[-1].key
    assert pages == [[f"{key_prefix}k{i:02d}" for i in (6, 5, 4)], [f"{key_prefix}k{i:02d}" for i in (3, 2, 1)],
                     [f"{key_prefix}k00"]]
    everything = await store.range(key_prefix, descending=True)
    assert [kv.key for kv in everything.kvs] == [f"{key_prefix}k{i:02d}" for i in reversed(range(7))]
    assert not everything.more


async def test_delete_prefix(store: Store, key_prefix: str) -> None:
    await store.put(key_prefix + "d/1", b"1")
    await store.put(key_prefix + "d/2", b"2")
    await store.put(key_prefix + "e", b"3")
    await store.txn([], [Delete(key_prefix + "d/", prefix=True)])
    assert [kv.key for kv in (await store.range(key_prefix)).kvs] == [key_prefix + "e"]
    assert await store.delete(key_prefix + "e") is True
    assert await store.delete(key_prefix + "e") is False


async def test_watch_sees_changes_from_a_revision(store: Store, key_prefix: str) -> None:
    rev = await store.put(key_prefix + "w/before", b"0")
    events: list[tuple[str, str]] = []
    got_all = asyncio.Event()

    async def consume() -> None:
        async for batch in store.watch(key_prefix + "w/", start_revision=rev):
            events.extend((e.kind, e.key.rsplit("/", 1)[-1]) for e in batch)
            if len(events) >= 3:
                got_all.set()
                return

    task = asyncio.create_task(consume())
    await store.put(key_prefix + "w/a", b"1")
    await store.delete(key_prefix + "w/a")
    await asyncio.wait_for(got_all.wait(), 10)
    await task
    assert events == [("put", "before"), ("put", "a"), ("delete", "a")]


async def test_lease_expiry_removes_keys(key_prefix: str) -> None:
    clock = ManualClock()
    store = MemoryStore(clock)
    lease = await store.grant_lease(2)
    await store.put(key_prefix + "l", b"1", lease=lease)
    assert await store.keepalive(lease) == 2
    clock.advance(3)
    assert await store.get(key_prefix + "l") is None
    assert await store.keepalive(lease) == 0
    with pytest.raises(FailedPrecondition):
        await store.put(key_prefix + "l2", b"1", lease=lease)


async def test_lease_revoke_and_keepalive(store: Store, key_prefix: str) -> None:
    lease = await store.grant_lease(30)
    await store.put(key_prefix + "l", b"1", lease=lease)
    assert (await store.get(key_prefix + "l")) is not None
    assert await store.keepalive(lease) > 0
    await store.revoke_lease(lease)
    assert await store.get(key_prefix + "l") is None
    await store.revoke_lease(lease)  # idempotent


async def test_a_put_under_a_gone_lease_fails_the_whole_transaction(store: Store, key_prefix: str) -> None:
    lease = await store.grant_lease(30)
    await store.revoke_lease(lease)
    before = await store.put(key_prefix + "before", b"0")
    with pytest.raises(FailedPrecondition):
        await store.txn([absent(key_prefix + "a")], [Put(key_prefix + "a", b"1"), Put(key_prefix + "b", b"2", lease)])
    assert await store.get(key_prefix + "a") is None and await store.get(key_prefix + "b") is None
    assert await store.put(key_prefix + "after", b"0") == before + 1  # the failed transaction made no revision


async def test_unreachable_etcd_is_unavailable() -> None:
    from trainyard_core.testing.etcd import free_port

    store = EtcdStore(f"127.0.0.1:{free_port()}", timeout=1.0)
    with pytest.raises(Unavailable, match="unavailable"):
        await store.get("/x")
    await store.close()



async def test_a_range_answer_larger_than_grpcs_default_limit(store: Store, key_prefix: str) -> None:
    """gRPC refuses answers over 4 MiB by default; one page of a few large records (a big gang's allocation)
    is larger, and must read as data, not as a member that failed."""
    value = b"x" * (1024 * 1024 + 300_000)  # under etcd's default --max-request-bytes (1.5 MiB) per write
    for i in range(4):
        await store.put(f"{key_prefix}big/{i}", value)
    page = await store.range(key_prefix + "big/")
    assert [len(kv.value) for kv in page.kvs] == [len(value)] * 4
