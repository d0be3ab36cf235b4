"""Retention of the history store, on SQLite and on a real PostgreSQL: revision 0002 lets usage records
outlive their job rows (a database migrated from 0001 keeps every row), and `prune` deletes what is older than
its cutoffs (exclusive), a batch per transaction, job rows with their labels, usage records on their own."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.util import CommandError
from sqlalchemy import event

from trainyard_scheduler.history import HistoryStore, HistoryUnavailable, JobFilter, Pruned
from trainyard_scheduler.history import migrate as migrations
from trainyard_scheduler.history.schema import metadata
from trainyard_scheduler.history.store import make_engine, parse_url

from .test_history_store import T0, job, job_id, usage

# Rows as revision 0001 stored them, written with plain SQL: the test must not lean on schema.py, which is the
# head's (a later revision may rename what 0001 had).
JOB_0001 = sa.text(
    "INSERT INTO jobs (job_id, team, user_name, name, queue, state, submitted_at, finished_at, archived_at, record) "
    "VALUES (:job_id, 'ml', 'ada', 'train', 'default', 'SUCCEEDED', :submitted, :finished, :finished, :record)")
LABEL_0001 = sa.text("INSERT INTO job_labels (job_id, key, value) VALUES (:job_id, :key, :value)")
USAGE_0001 = sa.text(
    "INSERT INTO usage_records (job_id, attempt, team, user_name, project, queue, accelerator_model, gpus, cpus, "
    "nodes, started_at, ended_at) VALUES (:job_id, :attempt, 'ml', 'ada', 'atlas', 'default', 'H100', 8, 64, 1, "
    ":started, :ended)")


@pytest.mark.filterwarnings("ignore:Skipped unsupported reflection of expression-based index")
@pytest.mark.filterwarnings("ignore:autogenerate skipping metadata-specified expression-based index")
async def test_a_database_at_0001_keeps_its_rows_through_0002_and_usage_then_outlives_its_job(
        history_url: str) -> None:
    engine = make_engine(parse_url(history_url))
    try:
        await migrations.upgrade(engine, "0001")
        assert await migrations.current(engine) == "0001"
        async with engine.begin() as conn:
            for n in (1, 2):
                await conn.execute(JOB_0001, {"job_id": job_id(n), "submitted": T0 + n * 60,
                                              "finished": T0 + n * 60 + 30, "record": b"record %d" % n})
                await conn.execute(LABEL_0001, {"job_id": job_id(n), "key": "project", "value": "atlas"})
                await conn.execute(USAGE_0001, [{"job_id": job_id(n), "attempt": a, "started": T0 + n * 60 + a,
                                                 "ended": T0 + n * 60 + 30} for a in (0, 1)])
        await migrations.upgrade(engine)
        assert await migrations.current(engine) == migrations.head() == "0005"
        async with engine.connect() as conn:
            diff = await conn.run_sync(lambda c: compare_metadata(
                MigrationContext.configure(c, opts={"compare_type": True}), metadata))
            assert diff == [], "a database migrated from 0001 has the head's schema"
            if engine.dialect.name == "sqlite":
                catalog = "SELECT name FROM sqlite_master WHERE type = 'index'"
                ddl = (await conn.execute(sa.text(
                    "SELECT sql FROM sqlite_master WHERE name = 'usage_records'"))).scalar_one()
                assert "WITHOUT ROWID" in ddl and "FOREIGN KEY" not in ddl, "batch mode kept the table's layout"
            else:
                catalog = "SELECT indexname FROM pg_indexes WHERE schemaname = current_schema()"
            indexes = {name for (name,) in await conn.execute(sa.text(catalog)) if name.startswith("ix_")}
        # The expression index too, which SQLite's reflection (and so a batch copy) would have lost.
        assert indexes == {index.name for table in metadata.tables.values() for index in table.indexes}
    finally:
        await engine.dispose()

    store = await HistoryStore.open(history_url, migrate=False)
    try:
        for n in (1, 2):
            got = await store.get(job_id(n))
            assert got is not None and got.record == b"record %d" % n and got.labels == {"project": "atlas"}
            assert [(u.attempt, u.started_at, u.gpus) for u in got.usage] == [
                (0, T0 + n * 60, 8), (1, T0 + n * 60 + 1, 8)]
        # Job 1 leaves the history; in 0001 its usage would have gone with it (ON DELETE CASCADE).
        assert await store.prune(jobs_before=T0 + 60 + 31, usage_before=None) == (1, 0)
        assert await store.get(job_id(1)) is None and await store.count() == 1
        assert sorted((u.job_id, u.attempt) for u in await store.usage()) == [
            (job_id(1), 0), (job_id(1), 1), (job_id(2), 0), (job_id(2), 1)]
        # And a job archived again after its row was pruned writes its usage over the surviving records.
        await store.archive([job(1, finished=T0 + 91, records=(usage(1, 0, gpus=2),))])
        got = await store.get(job_id(1))
        assert got is not None and [(u.attempt, u.gpus) for u in got.usage] == [(0, 2), (1, 8)]
    finally:
        await store.close()


async def test_downgrading_below_0002_refuses_usage_whose_job_is_gone(history_url: str) -> None:
    store = await HistoryStore.open(history_url)
    try:
        await store.archive([job(1, records=(usage(1, 0),)), job(2, records=(usage(2, 0),))])
        await store.prune(jobs_before=T0 + 60 + 31, usage_before=None)
    finally:
        await store.close()
    engine = make_engine(parse_url(history_url))
    try:
        with pytest.raises(CommandError, match="1 usage records belong to jobs no longer in it"):
            await migrations.downgrade(engine, "0001")
        assert await migrations.current(engine) == "0005", "nothing changed"
        async with engine.begin() as conn:
            await conn.execute(sa.text("DELETE FROM usage_records WHERE job_id NOT IN (SELECT job_id FROM jobs)"))
        await migrations.downgrade(engine, "0001")
        assert await migrations.current(engine) == "0001"
        await migrations.upgrade(engine)
    finally:
        await engine.dispose()


@pytest.fixture
def commits(store: HistoryStore) -> Iterator[list[int]]:
    """Counts the store's transactions that commit (one per prune batch)."""
    seen: list[int] = []

    def count(_conn: sa.Connection) -> None:
        seen.append(1)

    event.listen(store.engine.sync_engine, "commit", count)
    try:
        yield seen
    finally:
        event.remove(store.engine.sync_engine, "commit", count)


async def test_prune_deletes_jobs_that_finished_before_the_cutoff_with_their_labels(store: HistoryStore) -> None:
    await store.archive([job(n, finished=T0 + n * 10, labels={"env": "prod", "n": str(n)},
                             records=(usage(n, 0, ended=T0),)) for n in (1, 2, 3)])
    assert await store.prune(jobs_before=T0 + 20, usage_before=None) == Pruned(jobs=1, usage=0)
    assert [j.job_id for j in await store.list(JobFilter(labels={"env": "prod"}), limit=10)] == [job_id(3), job_id(2)]
    assert await store.get(job_id(1)) is None
    assert await store.list(JobFilter(labels={"n": "1"}), limit=10) == []
    async with store.engine.connect() as conn:
        labels = (await conn.execute(sa.text("SELECT job_id FROM job_labels ORDER BY job_id"))).scalars().all()
    assert labels == [job_id(2), job_id(2), job_id(3), job_id(3)], "the pruned job's labels went with it"
    # Exclusive: the job that finished exactly at the cutoff stayed; usage is untouched by a job prune.
    assert len(await store.usage()) == 3
    assert await store.prune(jobs_before=T0 + 20, usage_before=None) == (0, 0), "idempotent"
    assert await store.prune(jobs_before=T0 + 20.000001, usage_before=None) == (1, 0)


async def test_prune_deletes_usage_that_ended_before_the_cutoff_and_keeps_the_jobs(store: HistoryStore) -> None:
    await store.archive([job(1, records=(usage(1, 0, ended=T0 + 100), usage(1, 1, ended=T0 + 200))),
                         job(2, records=(usage(2, 0, ended=T0 + 50),))])
    assert await store.prune(jobs_before=None, usage_before=T0 + 200) == Pruned(jobs=0, usage=2)
    assert [(u.job_id, u.attempt) for u in await store.usage()] == [(job_id(1), 1)]
    got = await store.get(job_id(1))
    assert await store.count() == 2 and got is not None and [u.attempt for u in got.usage] == [1]
    assert await store.prune(jobs_before=None, usage_before=None) == (0, 0)


async def test_both_kinds_in_one_prune_on_their_own_cutoffs(store: HistoryStore) -> None:
    await store.archive([job(n, finished=T0 + n, records=(usage(n, 0, ended=T0 + 1000 + n),)) for n in range(1, 6)])
    assert await store.prune(jobs_before=T0 + 3, usage_before=T0 + 1005) == (2, 4)
    assert await store.count() == 3
    assert [u.job_id for u in await store.usage()] == [job_id(5)]


async def test_prune_works_in_batches_one_transaction_each_oldest_first(store: HistoryStore,
                                                                        commits: list[int]) -> None:
    # Archived newest first, so that oldest-first deletion is not just insertion order.
    await store.archive([job(n, finished=T0 + n, records=(usage(n, 0, ended=T0 + n),)) for n in range(25, 0, -1)])
    commits.clear()
    assert await store.prune(jobs_before=T0 + 100, usage_before=None, batch=10) == (25, 0)
    assert len(commits) == 3, "10 + 10 + 5: the short batch ends it"

    # A budget of batches: what is left waits for the next call, oldest gone first.
    commits.clear()
    assert await store.prune(jobs_before=None, usage_before=T0 + 100, batch=10, max_batches=2) == (0, 20)
    assert len(commits) == 2
    assert [u.job_id for u in await store.usage()] == [job_id(n) for n in range(21, 26)]
    assert await store.prune(jobs_before=None, usage_before=T0 + 100, batch=10, max_batches=2) == (0, 5)

    # A batch that comes back exactly full is followed by one that finds nothing.
    await store.archive([job(n, finished=T0 + n) for n in range(1, 11)])
    commits.clear()
    assert await store.prune(jobs_before=T0 + 100, usage_before=None, batch=5) == (10, 0)
    assert len(commits) == 3


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"batch": 0}, "batch must be at least 1"),
    ({"batch": 10, "max_batches": 0}, "max_batches must be at least 1"),
])
async def test_prune_refuses_a_batch_or_budget_below_one(store: HistoryStore, kwargs: dict[str, int],
                                                         message: str) -> None:
    with pytest.raises(ValueError, match=message):
        await store.prune(jobs_before=T0, usage_before=T0, **kwargs)


async def test_prune_while_another_writer_holds_sqlite_is_unavailable(sqlite_url: str) -> None:
    store = await HistoryStore.open(sqlite_url, query_timeout=0.3)
    other = sqlite3.connect(parse_url(sqlite_url).database or "", isolation_level=None)  # another process
    try:
        await store.archive([job(1, finished=T0)])
        other.execute("BEGIN IMMEDIATE")
        with pytest.raises(HistoryUnavailable, match=r"prune jobs finished before .*database is locked"):
            await store.prune(jobs_before=T0 + 1, usage_before=None)
        other.execute("ROLLBACK")
        assert await store.prune(jobs_before=T0 + 1, usage_before=None) == (1, 0)
    finally:
        other.close()
        await store.close()
