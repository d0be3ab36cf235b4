"""Group commit of independent writes (trainyard_core.store.batch): grouped, yet each write's result its own."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence

from trainyard_core.errors import Unavailable
from trainyard_core.store.api import Compare, Op, Put, TxnResult, absent
from trainyard_core.store.batch import TxnBatcher
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.store.memory import MemoryStore


class CountingStore(MemoryStore):
    """The memory store, counting the transactions it is sent and how many operations each carried; a
    transaction can be held open (`gate`) so that writes queue behind it, and can fail (`fail_next`)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []
        self.gate: asyncio.Event | None = None
        self.fail_next = 0

    async def txn(self, compares: Sequence[Compare], success: Sequence[Op],
                  failure: Sequence[Op] = ()) -> TxnResult:
        self.sizes.append(len(success))
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_next:
            self.fail_next -= 1
            raise Unavailable("etcd did not answer")
        return await super().txn(compares, success, failure)


async def _write(batch: TxnBatcher, key: str) -> TxnResult:
    return await batch.txn([absent(key)], [Put(key, key.encode())])


async def test_an_idle_write_goes_alone_at_once() -> None:
    store = CountingStore()
    batch = TxnBatcher(store)
    res = await _write(batch, "/a")
    assert res.succeeded and store.sizes == [1]
    assert (await store.get("/a")) is not None


async def test_writes_that_wait_go_together_and_all_land() -> None:
    store = CountingStore()
    store.gate = asyncio.Event()
    batch = TxnBatcher(store, max_in_flight=1)
    first = asyncio.ensure_future(_write(batch, "/k/0"))
    await asyncio.sleep(0)
    rest = [asyncio.ensure_future(_write(batch, f"/k/{i}")) for i in range(1, 41)]
    await asyncio.sleep(0)
    store.gate.set()
    results = await asyncio.gather(first, *rest)
    assert all(r.succeeded for r in results)
    assert store.sizes == [1, 40]  # the first alone, the forty that waited in one transaction
    assert len({r.revision for r in results[1:]}) == 1
    assert batch.transactions == 2 and batch.grouped == 1
    for i in range(41):
        assert (await store.get(f"/k/{i}")) is not None


async def test_a_group_respects_the_operation_budget() -> None:
    store = CountingStore()
    store.gate = asyncio.Event()
    batch = TxnBatcher(store, max_in_flight=1, max_ops=10)
    writes = [asyncio.ensure_future(_write(batch, f"/k/{i}")) for i in range(26)]
    await asyncio.sleep(0)
    store.gate.set()
    assert all(r.succeeded for r in await asyncio.gather(*writes))
    assert store.sizes == [1, 10, 10, 5]


async def test_one_failed_compare_fails_only_its_own_write() -> None:
    store = CountingStore()
    await store.put("/k/13", b"taken")
    store.gate = asyncio.Event()
    batch = TxnBatcher(store, max_in_flight=1)
    blocker = asyncio.ensure_future(_write(batch, "/blocker"))
    await asyncio.sleep(0)
    writes = [asyncio.ensure_future(_write(batch, f"/k/{i}")) for i in range(32)]
    await asyncio.sleep(0)
    store.gate.set()
    await blocker
    results = await asyncio.gather(*writes)
    assert [i for i, r in enumerate(results) if not r.succeeded] == [13]
    assert (await store.get("/k/13")).value == b"taken"  # type: ignore[union-attr]
    for i in range(32):
        if i != 13:
            assert (await store.get(f"/k/{i}")).value == f"/k/{i}".encode()  # type: ignore[union-attr]
    # 32 split in halves down to the failing one: 1 + log2(32) failed groups, then the rest in few groups.
    assert len(store.sizes) <= 1 + 1 + 2 * 6


async def test_a_raised_error_reaches_every_write_of_its_group_and_later_writes_go_on() -> None:
    store = CountingStore()
    store.gate = asyncio.Event()
    batch = TxnBatcher(store, max_in_flight=1)
    first = asyncio.ensure_future(_write(batch, "/first"))
    await asyncio.sleep(0)
    grouped = [asyncio.ensure_future(_write(batch, f"/k/{i}")) for i in range(5)]
    await asyncio.sleep(0)
    store.fail_next = 2  # the first transaction and the group behind it
    store.gate.set()
    outcomes = await asyncio.gather(first, *grouped, return_exceptions=True)
    assert all(isinstance(o, Unavailable) for o in outcomes)
    store.gate = None
    assert (await _write(batch, "/after")).succeeded


async def test_a_write_never_shares_a_transaction_with_another_of_the_same_key() -> None:
    store = CountingStore()
    store.gate = asyncio.Event()
    batch = TxnBatcher(store, max_in_flight=1)
    blocker = asyncio.ensure_future(_write(batch, "/blocker"))
    await asyncio.sleep(0)
    a = asyncio.ensure_future(batch.txn([], [Put("/same", b"a")]))
    b = asyncio.ensure_future(batch.txn([], [Put("/same", b"b")]))
    other = asyncio.ensure_future(_write(batch, "/other"))
    await asyncio.sleep(0)
    store.gate.set()
    await asyncio.gather(blocker, a, b, other)
    assert store.sizes == [1, 2, 1]  # /same (a) with /other, then /same (b) alone
    assert (await store.get("/same")).value == b"b"  # type: ignore[union-attr]


async def test_a_cancelled_caller_that_still_waits_is_not_sent() -> None:
    store = CountingStore()
    store.gate = asyncio.Event()
    batch = TxnBatcher(store, max_in_flight=1)
    blocker = asyncio.ensure_future(_write(batch, "/blocker"))
    await asyncio.sleep(0)
    gone = asyncio.ensure_future(_write(batch, "/gone"))
    kept = asyncio.ensure_future(_write(batch, "/kept"))
    await asyncio.sleep(0)
    gone.cancel()
    store.gate.set()
    await asyncio.gather(blocker, kept)
    assert await store.get("/gone") is None and await store.get("/kept") is not None


async def test_random_groups_on_real_etcd_give_every_write_its_own_result(etcd_store: EtcdStore,
                                                                           key_prefix: str) -> None:
    """Against a real etcd: a mix of writes that land and writes whose key exists, sent concurrently; each
    gets the answer it would have had alone, and etcd holds exactly the landed ones."""
    rng = random.Random(7)
    taken = set(rng.sample(range(200), 20))
    for i in taken:
        await etcd_store.put(f"{key_prefix}/k/{i}", b"taken")
    batch = TxnBatcher(etcd_store)
    results = await asyncio.gather(*(_write(batch, f"{key_prefix}/k/{i}") for i in range(200)))
    assert {i for i, r in enumerate(results) if not r.succeeded} == taken
    page = await etcd_store.range(f"{key_prefix}/k/", limit=1000)
    values = {kv.key.rsplit("/", 1)[1]: kv.value for kv in page.kvs}
    assert len(values) == 200
    for i in range(200):
        assert values[str(i)] == (b"taken" if i in taken else f"{key_prefix}/k/{i}".encode())
    assert batch.grouped > 0


async def test_writes_that_all_land_take_a_few_transactions_on_real_etcd(etcd_store: EtcdStore,
                                                                        key_prefix: str) -> None:
    batch = TxnBatcher(etcd_store)
    results = await asyncio.gather(*(_write(batch, f"{key_prefix}/n/{i}") for i in range(200)))
    assert all(r.succeeded for r in results)
    assert len((await etcd_store.range(f"{key_prefix}/n/", limit=1000)).kvs) == 200
    # Two sent alone at once, the other 198 in groups of at most MAX_GROUP_OPS (64).
    assert batch.transactions <= 2 + 4


async def test_a_write_whose_lease_is_gone_fails_alone() -> None:
    """etcd refuses a whole transaction whose put names a lease it no longer has: in a group, only the write
    that named it hears of it; the others land."""
    from trainyard_core.errors import FailedPrecondition

    store = CountingStore()
    gone = await store.grant_lease(60)
    await store.revoke_lease(gone)
    store.gate = asyncio.Event()
    batch = TxnBatcher(store, max_in_flight=1)
    blocker = asyncio.ensure_future(_write(batch, "/blocker"))
    await asyncio.sleep(0)
    writes = [asyncio.ensure_future(batch.txn([absent(f"/k/{i}")], [Put(f"/k/{i}", b"v", gone if i == 5 else 0)]))
              for i in range(12)]
    await asyncio.sleep(0)
    store.gate.set()
    await blocker
    outcomes = await asyncio.gather(*writes, return_exceptions=True)
    assert [i for i, o in enumerate(outcomes) if isinstance(o, FailedPrecondition)] == [5]
    assert all(o.succeeded for i, o in enumerate(outcomes) if i != 5)  # type: ignore[union-attr]
    assert await store.get("/k/5") is None and await store.get("/k/4") is not None
