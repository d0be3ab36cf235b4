"""The audit log in the history store, on SQLite and a real PostgreSQL, with the session's real etcd: the
table's filters say what `AuditFilter.matches` says; the leader's mover takes every entry out of etcd exactly
once, repeats safely after a crash, leaves everything in etcd while the database is down; and a read merges
both parts into one newest-first log with stable pages."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from trainyard_core.audit import AuditEntry, AuditFilter, AuditLog, AuditPage, new_entry_id
from trainyard_core.clock import ManualClock
from trainyard_core.errors import Unavailable
from trainyard_core.store.etcd import EtcdStore
from trainyard_scheduler.audit_archive import AuditMover, AuditReader, MoveSettings, merge
from trainyard_scheduler.history import HistoryStore, HistoryUnavailable
from trainyard_scheduler.history.access import History

T0 = 1_800_000_000.0
ACTIONS = ["/trainyard.scheduler.v1.JobService/CancelJob", "/trainyard.scheduler.v1.JobService/SubmitJob",
           "POST /v1/jobs", "POST /v1/jobs/{job_id}/cancel", "DELETE /v1/tokens/{token_id}"]
PRINCIPALS = ["user:vision/alice", "user:nlp/alice", "user:nlp/bob", "trainyard://gateway", "anonymous"]


def entries(n: int, seed: int = 3) -> list[AuditEntry]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        principal = rng.choice(PRINCIPALS)
        out.append(AuditEntry.make(
            time=T0 + i * 0.5 + rng.choice([0.0, 0.0000004]), principal=principal, service=rng.choice(
                ["gateway", "scheduler"]), action=rng.choice(ACTIONS), target=f"job/j-{rng.randrange(5)}",
            result=rng.choice(["ok", "ok", "permission_denied"]), request_id=f"req-{rng.randrange(8)}",
            team=principal.partition(":")[2].partition("/")[0] if principal.startswith("user:") else "",
            detail={"http_status": rng.choice([200, 403])}))
    return out


FILTERS = [AuditFilter(), AuditFilter(user="alice"), AuditFilter(user="alice", team="nlp"),
           AuditFilter(principal="trainyard://gateway"), AuditFilter(action="CancelJob"),
           AuditFilter(action="cancel"), AuditFilter(action="jobs/{job_id}/cancel"),
           AuditFilter(action="POST /v1/jobs"),
           AuditFilter(target="job/j-1", result="ok"), AuditFilter(request_id="req-3"),
           AuditFilter(since=T0 + 10, until=T0 + 40.5), AuditFilter(since=T0 + 40.0000004),
           AuditFilter(until=T0 + 12, team="vision"), AuditFilter(result="permission_denied", since=T0 + 50)]


async def stored(log: AuditLog, items: list[AuditEntry]) -> list[AuditEntry]:
    """`items` appended to etcd, as each service does, read back with their ids."""
    for e in items:
        assert await log.append(e)
    page = await log.query(AuditFilter(), page_size=500)
    assert len(page.entries) == len(items) and not page.next_page_token
    return page.entries


async def read_all(query: AuditReader | HistoryStore, flt: AuditFilter, size: int) -> list[AuditEntry]:
    out: list[AuditEntry] = []
    token = ""
    for _ in range(1000):
        if isinstance(query, HistoryStore):
            got = await query.audit.page(flt, limit=size, after=token)
            page = AuditPage(got, got[-1].id if len(got) == size else "")
        else:
            page = await query.query(flt, page_size=size, page_token=token)
        assert len(page.entries) <= size
        out += page.entries
        token = page.next_page_token
        if not token:
            return out
    raise AssertionError("paging did not end")


@pytest.fixture
async def store(history_url: str) -> AsyncIterator[HistoryStore]:
    s = await HistoryStore.open(history_url)
    try:
        yield s
    finally:
        await s.close()


def mover(etcd_store: EtcdStore, log: AuditLog, history: History, **kw: object) -> AuditMover:
    settings = MoveSettings(retention_s=86400.0, chunk=7, txn_ops=3, **kw)  # type: ignore[arg-type]
    return AuditMover(store=etcd_store, log_=log, history=history, clock=ManualClock(start=T0 + 3600),
                      settings=settings)


async def test_the_tables_filters_say_what_the_filter_says(store: HistoryStore, etcd_store: EtcdStore,
                                                           key_prefix: str) -> None:
    items = await stored(AuditLog(etcd_store, key_prefix), entries(120))
    await store.audit.add(items)
    await store.audit.add(items[:40])  # again: the first copy stays, nothing doubles
    assert await store.audit.count() == 120
    for flt in FILTERS:
        want = [e for e in items if flt.matches(e)]
        assert want, f"{flt} selects something"
        for size in (1, 7, 500):
            assert await read_all(store, flt, size) == want, (flt, size)


async def test_the_mover_takes_every_entry_out_of_etcd_once(history_url: str, etcd_store: EtcdStore,
                                                            key_prefix: str) -> None:
    log = AuditLog(etcd_store, key_prefix)
    items = await stored(log, entries(40))
    history = History(history_url)
    try:
        table = (await history.store()).audit
        # A leader that stored the first entries and died before deleting them from etcd.
        await table.add(items[:9])
        moving = mover(etcd_store, log, history, max_chunks=2)
        assert await moving.step() == 14, "two chunks of 7 a pass"
        while await moving.step():
            pass
        assert (await etcd_store.range(log.prefix)).kvs == []
        assert await table.count() == 40
        assert await read_all(await history.store(), AuditFilter(), 500) == items
    finally:
        await history.close()


async def test_a_database_that_is_down_leaves_the_entries_in_etcd(etcd_store: EtcdStore, key_prefix: str,
                                                                 tmp_path: object) -> None:
    log = AuditLog(etcd_store, key_prefix)
    items = await stored(log, entries(5))
    history = History(f"sqlite+aiosqlite:///{tmp_path}/no/such/dir/history.db")
    with pytest.raises(HistoryUnavailable):
        await mover(etcd_store, log, history).step()
    assert len((await etcd_store.range(log.prefix)).kvs) == len(items)
    with pytest.raises(Unavailable, match="history store"):
        await AuditReader(log, history).query(AuditFilter(), page_size=10)


async def test_a_read_merges_etcd_and_the_history_into_one_log(history_url: str, etcd_store: EtcdStore,
                                                               key_prefix: str) -> None:
    log = AuditLog(etcd_store, key_prefix)
    items = await stored(log, entries(60, seed=11))
    history = History(history_url)
    try:
        table = (await history.store()).audit
        rng = random.Random(5)
        moved = [e for e in items if rng.random() < 0.6]
        await table.add(moved)
        # Some of the moved ones are gone from etcd, others not yet (a pass between its two steps).
        for e in moved[::2]:
            await etcd_store.delete(log.key(e.id))
        reader = AuditReader(log, history)
        for flt in FILTERS:
            want = [e for e in items if flt.matches(e)]
            for size in (1, 3, 50):
                assert await read_all(reader, flt, size) == want, (flt, size)
        # A page token stays good while entries move between the two parts.
        first = await reader.query(AuditFilter(), page_size=10)
        while await mover(etcd_store, log, history).step():
            pass
        rest = await read_all_after(reader, first.next_page_token)
        assert first.entries + rest == items
    finally:
        await history.close()


async def read_all_after(reader: AuditReader, token: str) -> list[AuditEntry]:
    out: list[AuditEntry] = []
    while token:
        page = await reader.query(AuditFilter(), page_size=7, page_token=token)
        out += page.entries
        token = page.next_page_token
    return out


async def test_old_entries_are_pruned_from_the_history(store: HistoryStore) -> None:
    items = [AuditEntry.make(time=T0 + i * 3600, principal="anonymous", service="gateway", action="POST /v1/jobs")
             for i in range(10)]
    with_ids = [replace(e, id=new_entry_id(e.time)) for e in items]
    await store.audit.add(with_ids)
    assert await store.audit.prune(before=T0 + 4 * 3600, batch=2) == 4
    left = await store.audit.page(AuditFilter(), limit=100)
    assert sorted(e.time for e in left) == [T0 + i * 3600 for i in range(4, 10)]
    assert await store.audit.prune(before=T0 + 4 * 3600) == 0


def test_merge_keeps_each_entry_once_and_stops_at_the_nearer_bound() -> None:
    rng = random.Random(1)
    ids = sorted(f"{rng.randrange(10**9):012d}" for _ in range(200))
    everything = [AuditEntry(time=0.0, principal="p", service="s", action="a", id=i) for i in ids]
    for trial in range(200):
        in_etcd = [e for e in everything if rng.random() < 0.5]
        in_sql = [e for e in everything if e not in in_etcd or rng.random() < 0.3]
        size = rng.choice([1, 2, 5, 20, 300])
        got: list[AuditEntry] = []
        token = ""
        while True:
            live = [e for e in in_etcd if e.id > token][:size]
            live_page = AuditPage(live, live[-1].id if len(live) == size else "")
            page = merge(live_page, [e for e in in_sql if e.id > token][:size + 1], size)
            assert len(page.entries) <= size
            got += page.entries
            token = page.next_page_token
            if not token:
                break
        assert got == everything, trial
