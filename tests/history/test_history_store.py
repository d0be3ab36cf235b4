"""The history store's contract, on SQLite and on a real PostgreSQL server alike (the `store` and
`history_url` fixtures run each test once per backend): what is archived comes back exactly, archiving again
is idempotent, every filter and their combinations select what they say newest first, keyset pages walk every
job once while newer jobs arrive, usage windows overlap as documented, the migrations bring an empty database
to head and back, and an unusable database is reported as HistoryUnavailable (or a bad URL as ValueError)
with the password masked."""

from __future__ import annotations

import asyncio
import socket
import sqlite3
import sys
import time
from asyncio.subprocess import PIPE, STDOUT
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy.ext.asyncio import AsyncEngine

from trainyard_core.testing import postgres
from trainyard_core.testing.etcd import free_port
from trainyard_scheduler.history import ArchivedJob, HistoryStore, HistoryUnavailable, JobFilter, UsageRecord
from trainyard_scheduler.history import migrate as migrations
from trainyard_scheduler.history import store as history_store
from trainyard_scheduler.history.schema import metadata
from trainyard_scheduler.history.store import _prefix_upper_bound, make_engine, parse_url

T0 = 1_764_633_600.125  # a float that is not a whole number of seconds, to check exact round trips

# Names whose order differs between code points and a linguistic collation (case, punctuation, astral plane).
NAMES = ["abc", "aBc", "ABD", "ab-c", "ab", "abz\U0001f600", "ac", "train-llama", "train-llama-70b", "Train-x",
         "eval", "ab\U0010ffff"]
TEAMS = ["ml", "vision", "speech"]
USERS = ["ada", "bob", "cy", "dee"]
STATES = ["SUCCEEDED", "FAILED", "CANCELLED"]
QUEUES = ["default", "batch"]


def job_id(n: int) -> str:
    return f"j-{n:06d}"


def usage(n: int, attempt: int, *, team: str = "ml", user: str = "ada", started: float = T0,
          ended: float = T0 + 60, gpus: int = 8, model: str = "H100") -> UsageRecord:
    return UsageRecord(job_id=job_id(n), attempt=attempt, team=team, user=user, project="atlas", queue="default",
                       accelerator_model=model, gpus=gpus, cpus=gpus * 8, nodes=1, started_at=started,
                       ended_at=ended)


def job(n: int, *, team: str = "ml", user: str = "ada", name: str = "train", queue: str = "default",
        state: str = "SUCCEEDED", labels: dict[str, str] | None = None, submitted: float | None = None,
        finished: float | None = None, records: tuple[UsageRecord, ...] = ()) -> ArchivedJob:
    submitted = T0 + n * 60 if submitted is None else submitted
    return ArchivedJob(job_id=job_id(n), team=team, user=user, name=name, queue=queue, state=state,
                       labels=labels if labels is not None else {}, submitted_at=submitted,
                       finished_at=submitted + 30 if finished is None else finished,
                       record=b'{"id":"%s","blob":"\x00\xff"}' % job_id(n).encode(), usage=records)


def ids(jobs: list[ArchivedJob]) -> list[str]:
    return [j.job_id for j in jobs]


async def test_archive_then_get_returns_exactly_what_was_stored(store: HistoryStore) -> None:
    stored = job(1, team="vision", user="bob", name="train-llama", queue="batch", state="FAILED",
                 labels={"project": "atlas", "näme": "wert ✓", "empty": ""}, submitted=T0, finished=T0 + 0.000001,
                 records=(usage(1, 0, started=T0 + 1.5, ended=T0 + 2.25), usage(1, 1, model="", gpus=0)))
    stored = replace(stored, record=bytes(range(256)) * 4)
    await store.archive([stored])
    got = await store.get(stored.job_id)
    assert got == stored
    assert got is not None and type(got.record) is bytes and got.usage == stored.usage
    assert await store.get("j-unknown") is None
    assert await store.count() == 1
    await store.archive([])
    assert await store.count() == 1


async def test_archiving_again_leaves_one_row_per_job_and_attempt_with_the_latest_values(store: HistoryStore) -> None:
    first = job(7, state="FAILED", labels={"project": "atlas", "old": "x"},
                records=(usage(7, 0, gpus=8), usage(7, 1, gpus=8)))
    other = job(8, labels={"project": "atlas"}, records=(usage(8, 0),))
    await store.archive([first, other])
    # The leader crashed after the SQL commit and repeats the archive, with values that changed meanwhile.
    again = replace(first, state="SUCCEEDED", name="renamed", finished_at=first.finished_at + 5,
                    labels={"project": "borealis"}, record=b"new",
                    usage=(usage(7, 0, gpus=4, ended=T0 + 99), usage(7, 1, gpus=2), usage(7, 2, gpus=1)))
    await store.archive([again, other])
    await store.archive([again])
    assert await store.count() == 2
    assert await store.get(first.job_id) == again
    assert await store.list(JobFilter(labels={"old": "x"}), limit=10) == [], "the replaced label is gone"
    records = await store.usage()
    assert sorted((u.job_id, u.attempt, u.gpus) for u in records) == [
        (job_id(7), 0, 4), (job_id(7), 1, 2), (job_id(7), 2, 1), (job_id(8), 0, 8)]
    # The same job twice in one batch counts once, the later one winning.
    await store.archive([replace(again, state="CANCELLED"), replace(again, state="FAILED")])
    got = await store.get(first.job_id)
    assert got is not None and got.state == "FAILED"
    # Usage is accounting: an archive that omits an attempt does not erase the record of it.
    await store.archive([replace(again, usage=(usage(7, 0, gpus=3),))])
    got = await store.get(first.job_id)
    assert got is not None and [(u.attempt, u.gpus) for u in got.usage] == [(0, 3), (1, 2), (2, 1)]


async def test_an_invalid_batch_writes_nothing(store: HistoryStore) -> None:
    good, bad = job(1), job(2, records=(usage(3, 0),))
    with pytest.raises(ValueError, match="usage record of job 'j-000003' given with job 'j-000002'"):
        await store.archive([good, bad])
    assert await store.count() == 0


def _dataset() -> list[ArchivedJob]:
    out = []
    for i in range(60):
        labels = {} if i % 7 == 0 else {"project": ["atlas", "borealis"][i % 2], "env": ["prod", "dev", "test"][i % 3]}
        out.append(job(i, team=TEAMS[i % 3], user=USERS[i % 4], name=NAMES[i % len(NAMES)], queue=QUEUES[(i // 2) % 2],
                       state=STATES[(i // 3) % 3], labels=labels, finished=T0 + i * 60 + 30 + (i % 5) * 100))
    return out


@dataclass(frozen=True)
class Case:
    what: str
    flt: JobFilter
    expect: Callable[[ArchivedJob], bool]


FILTER_CASES = [
    Case("no filter", JobFilter(), lambda j: True),
    Case("team", JobFilter(team="vision"), lambda j: j.team == "vision"),
    Case("user", JobFilter(user="bob"), lambda j: j.user == "bob"),
    Case("one state", JobFilter(states=frozenset({"FAILED"})), lambda j: j.state == "FAILED"),
    Case("two states", JobFilter(states=frozenset({"FAILED", "CANCELLED"})), lambda j: j.state != "SUCCEEDED"),
    Case("queue", JobFilter(queue="batch"), lambda j: j.queue == "batch"),
    Case("one label", JobFilter(labels={"project": "atlas"}), lambda j: j.labels.get("project") == "atlas"),
    Case("two labels", JobFilter(labels={"project": "atlas", "env": "prod"}),
         lambda j: j.labels.get("project") == "atlas" and j.labels.get("env") == "prod"),
    Case("label nobody has", JobFilter(labels={"project": "nope"}), lambda j: False),
    Case("name prefix ab (not aBc, ABD, ac)", JobFilter(name_prefix="ab"), lambda j: j.name.startswith("ab")),
    Case("name prefix train-llama", JobFilter(name_prefix="train-llama"), lambda j: j.name.startswith("train-llama")),
    Case("name prefix is case-sensitive", JobFilter(name_prefix="A"), lambda j: j.name.startswith("A")),
    Case("name prefix beyond the BMP", JobFilter(name_prefix="abz\U0001f600"),
         lambda j: j.name.startswith("abz\U0001f600")),
    Case("name prefix ending in the last code point", JobFilter(name_prefix="ab\U0010ffff"),
         lambda j: j.name.startswith("ab\U0010ffff")),
    Case("submitted range: after inclusive, before exclusive",
         JobFilter(submitted_after=T0 + 10 * 60, submitted_before=T0 + 20 * 60),
         lambda j: T0 + 600 <= j.submitted_at < T0 + 1200),
    Case("submitted after only", JobFilter(submitted_after=T0 + 50 * 60), lambda j: j.submitted_at >= T0 + 3000),
    Case("finished range", JobFilter(finished_after=T0 + 1000, finished_before=T0 + 2000),
         lambda j: T0 + 1000 <= j.finished_at < T0 + 2000),
    Case("finished before only", JobFilter(finished_before=T0 + 500), lambda j: j.finished_at < T0 + 500),
    Case("everything at once",
         JobFilter(team="ml", states=frozenset({"SUCCEEDED", "FAILED"}), queue="default",
                   labels={"project": "borealis", "env": "prod"}, submitted_after=T0 + 60,
                   submitted_before=T0 + 3000, finished_after=T0, finished_before=T0 + 4000),
         lambda j: (j.team == "ml" and j.state in {"SUCCEEDED", "FAILED"} and j.queue == "default"
                    and j.labels.get("project") == "borealis" and j.labels.get("env") == "prod"
                    and T0 + 60 <= j.submitted_at < T0 + 3000 and T0 <= j.finished_at < T0 + 4000)),
    Case("user, label and prefix", JobFilter(user="ada", labels={"env": "test"}, name_prefix="train"),
         lambda j: j.user == "ada" and j.labels.get("env") == "test" and j.name.startswith("train")),
    Case("team and state", JobFilter(team="speech", states=frozenset({"CANCELLED"})),
         lambda j: j.team == "speech" and j.state == "CANCELLED"),
]


@pytest.fixture(params=["index-driven", "walked"])
def page_plan(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways `list` reads a label, name or time filter: with the tests' few jobs the bounded counts always
    find few matches (the filter's index drives the page); with the caps at 1 they always find many (an
    ordered walk checks the filter through an expression no index serves)."""
    if request.param == "walked":
        monkeypatch.setattr(history_store, "_LABEL_DRIVER_CAP", 1)
        monkeypatch.setattr(history_store, "_RANGE_DRIVER_CAP", 1)
    return str(request.param)


async def test_every_filter_alone_and_combined_selects_its_jobs_newest_first(store: HistoryStore,
                                                                             page_plan: str) -> None:
    data = _dataset()
    await store.archive(data)
    nonempty = 0
    for case in FILTER_CASES:
        expected = sorted((j for j in data if case.expect(j)), key=lambda j: j.job_id, reverse=True)
        got = await store.list(case.flt, limit=1000)
        assert ids(got) == ids(expected), f"{case.what} ({page_plan})"
        assert got == expected, f"{case.what}: whole jobs, labels and usage included"
        nonempty += bool(expected)
        if len(expected) > 2:
            assert ids(await store.list(case.flt, limit=2)) == ids(expected)[:2], f"{case.what}, limit 2"
            assert ids(await store.list(case.flt, limit=100, before=expected[1].job_id)) == ids(expected)[2:], \
                f"{case.what}, before the second"
    assert nonempty >= len(FILTER_CASES) - 1, "only the label nobody has may select nothing"


async def test_a_limit_below_one_is_refused(store: HistoryStore) -> None:
    with pytest.raises(ValueError, match="limit must be at least 1"):
        await store.list(JobFilter(), limit=0)
    with pytest.raises(ValueError, match="limit must be at least 1"):
        await store.usage(limit=0)


@pytest.mark.parametrize("flt", [JobFilter(), JobFilter(team="ml")], ids=["all", "team"])
async def test_pages_walk_every_job_once_while_newer_jobs_arrive(store: HistoryStore, flt: JobFilter) -> None:
    existing = [job(n, team=TEAMS[n % 2]) for n in range(0, 230, 2)]
    await store.archive(existing)
    seen: list[str] = []
    before, newer, pages = "", 1000, 0
    while True:
        page = await store.list(flt, limit=7, before=before)
        if not page:
            break
        assert len(page) <= 7
        seen += ids(page)
        before = page[-1].job_id
        pages += 1
        # Jobs finishing while someone pages: newer ids, so they land before the first page, not in the walk.
        await store.archive([job(newer, team="ml"), job(newer + 1, team="vision")])
        newer += 2
    want = sorted((j.job_id for j in existing if not flt.team or j.team == flt.team), reverse=True)
    assert seen == want, "every job exactly once, in order"
    assert pages == -(-len(want) // 7)
    assert ids(await store.list(flt, limit=1))[0] > want[0], "the newer jobs are there for a fresh walk"


async def test_usage_by_team_and_time_window(store: HistoryStore) -> None:
    a0 = usage(1, 0, team="ml", started=T0, ended=T0 + 100)
    a1 = usage(1, 1, team="ml", started=T0 + 200, ended=T0 + 300)
    b0 = usage(2, 0, team="vision", user="bob", started=T0 + 50, ended=T0 + 400)
    c0 = usage(3, 0, team="ml", started=T0 + 500, ended=T0 + 600)
    assert await store.usage(since=T0) == [], "no records at all"
    await store.archive([job(1, records=(a0, a1)), job(2, team="vision", records=(b0,)), job(3, records=(c0,)),
                         job(4)])
    assert await store.usage() == [a0, b0, a1, c0], "ordered by start"
    assert await store.usage(team="ml") == [a0, a1, c0]
    assert await store.usage(team="nobody") == []
    assert await store.usage(since=T0 + 100) == [b0, a1, c0], "a record that ended at `since` is outside"
    assert await store.usage(until=T0 + 200) == [a0, b0], "a record that starts at `until` is outside"
    assert await store.usage(since=T0 + 250, until=T0 + 450) == [b0, a1]
    assert await store.usage(team="vision", since=T0 + 250, until=T0 + 450) == [b0]
    assert await store.usage(team="ml", since=T0 + 301, until=T0 + 499) == []
    assert await store.usage(limit=2) == [a0, b0]
    # A record that spans the whole window started long before it: found all the same.
    spanning = usage(5, 0, team="ml", started=T0 - 86_400, ended=T0 + 86_400)
    await store.archive([job(5, records=(spanning,))])
    assert await store.usage(team="ml", since=T0 + 301, until=T0 + 499) == [spanning]
    assert await store.usage(since=T0 + 250, until=T0 + 450) == [spanning, b0, a1]
    assert await store.usage(since=T0 + 86_400) == [], "ended exactly at since"


def test_prefix_upper_bound_is_the_least_string_above_the_prefix() -> None:
    assert _prefix_upper_bound("ab") == "ac"
    assert _prefix_upper_bound("a\U0010ffff") == "b"
    assert _prefix_upper_bound("\U0010ffff") is None
    assert _prefix_upper_bound("a\ud7ff") == "a\ue000", "the surrogates are skipped"


# --- migrations -----------------------------------------------------------------------------------------------

async def test_open_brings_an_empty_database_to_head_and_opening_again_is_a_no_op(history_url: str) -> None:
    store = await HistoryStore.open(history_url)
    try:
        assert await migrations.current(store.engine) == migrations.head()
        await store.archive([job(1, labels={"project": "atlas"})])
    finally:
        await store.close()
    for migrate in (True, False):
        again = await HistoryStore.open(history_url, migrate=migrate)
        try:
            assert await migrations.current(again.engine) == migrations.head()
            assert await again.count() == 1
            assert await again.get(job_id(1)) == job(1, labels={"project": "atlas"})
        finally:
            await again.close()


async def test_upgrade_downgrade_upgrade_and_the_version_table_names_the_head(history_url: str) -> None:
    engine = make_engine(parse_url(history_url))
    try:
        assert await migrations.current(engine) is None
        await migrations.upgrade(engine)
        assert await _tables(engine) >= {"jobs", "job_labels", "usage_records", "alembic_version"}
        async with engine.connect() as conn:
            versions = (await conn.execute(sa.text("SELECT version_num FROM alembic_version"))).scalars().all()
        assert versions == [migrations.head()] == ["0005"]
        await migrations.upgrade(engine)  # already there
        await migrations.downgrade(engine, "base")
        assert await migrations.current(engine) is None
        assert await _tables(engine) <= {"alembic_version"}
        await migrations.upgrade(engine, "head")
        assert await migrations.current(engine) == migrations.head()
    finally:
        await engine.dispose()
    store = await HistoryStore.open(history_url, migrate=False)
    try:
        await store.archive([job(1)])
        assert await store.count() == 1
    finally:
        await store.close()


# Neither SQLAlchemy nor Alembic reflect expression indexes on SQLite; the test checks their names itself.
@pytest.mark.filterwarnings("ignore:Skipped unsupported reflection of expression-based index")
@pytest.mark.filterwarnings("ignore:autogenerate skipping metadata-specified expression-based index")
async def test_the_migrations_create_exactly_the_schema_the_store_queries(history_url: str) -> None:
    engine = make_engine(parse_url(history_url))
    try:
        await migrations.upgrade(engine)
        async with engine.connect() as conn:
            diff = await conn.run_sync(lambda c: compare_metadata(
                MigrationContext.configure(c, opts={"compare_type": True, "compare_server_default": True}), metadata))
            catalog = ("SELECT indexname FROM pg_indexes WHERE schemaname = current_schema()"
                       if engine.dialect.name == "postgresql"
                       else "SELECT name FROM sqlite_master WHERE type = 'index'")
            indexes = {name for (name,) in await conn.execute(sa.text(catalog)) if name.startswith("ix_")}
        assert diff == []
        assert indexes == {index.name for table in metadata.tables.values() for index in table.indexes}
        if engine.dialect.name == "postgresql":
            # compare_metadata does not compare collations: the ordered columns must be "C" (see schema.py), or a
            # linguistic database collation would leave their indexes unusable for the store's C comparisons.
            async with engine.connect() as conn:
                collated = {(table, column) for table, column in await conn.execute(sa.text(
                    "SELECT table_name, column_name FROM information_schema.columns "
                    "WHERE table_schema = current_schema() AND collation_name = 'C'"))}
            assert collated == {("jobs", "job_id"), ("jobs", "name"), ("job_labels", "job_id"),
                                ("usage_records", "job_id"), ("audit_entries", "id")}
    finally:
        await engine.dispose()


async def test_concurrent_opens_of_an_empty_database_migrate_it_once(history_url: str) -> None:
    stores = await asyncio.gather(*(HistoryStore.open(history_url) for _ in range(4)))
    try:
        await asyncio.gather(*(s.archive([job(i)]) for i, s in enumerate(stores)))
        assert await stores[0].count() == 4
        assert await migrations.current(stores[0].engine) == migrations.head()
    finally:
        await asyncio.gather(*(s.close() for s in stores))


# A scheduler replica in a process of its own: import, say so, and once given the URL open it (migrating),
# archive one job, close. The URL comes only when every replica is ready, so that they open together.
REPLICA = """
import asyncio, sys
from trainyard_scheduler.history import ArchivedJob, HistoryStore

async def main(url, n):
    store = await HistoryStore.open(url)
    try:
        await store.archive([ArchivedJob(f"j-{n:06d}", "ml", "ada", "train", "default", "SUCCEEDED", {}, 1.0, 2.0,
                                         b"{}")])
    finally:
        await store.close()

print("ready", flush=True)
asyncio.run(main(sys.stdin.readline().strip(), int(sys.argv[1])))
"""


async def test_replicas_in_separate_processes_open_an_empty_database_together(history_url: str) -> None:
    """The cross-process locks (PostgreSQL's advisory lock, SQLite's write lock) let exactly one migrate."""
    replicas = [await asyncio.create_subprocess_exec(sys.executable, "-c", REPLICA, str(n), stdin=PIPE, stdout=PIPE,
                                                     stderr=STDOUT) for n in range(2)]
    for replica in replicas:
        assert replica.stdout is not None
        assert await replica.stdout.readline() == b"ready\n"
    outputs = await asyncio.gather(*(r.communicate(history_url.encode() + b"\n") for r in replicas))
    for replica, (out, _) in zip(replicas, outputs, strict=True):
        assert replica.returncode == 0, out.decode()
    store = await HistoryStore.open(history_url, migrate=False)
    try:
        assert await store.count() == 2
    finally:
        await store.close()


async def test_open_without_migrate_refuses_a_database_without_the_schema(history_url: str) -> None:
    with pytest.raises(HistoryUnavailable, match=r"revision none \(empty database\).*migrate"):
        await HistoryStore.open(history_url, migrate=False)


async def test_a_schema_from_a_newer_version_is_reported_not_migrated(history_url: str) -> None:
    engine = make_engine(parse_url(history_url))
    try:
        await migrations.upgrade(engine)
        async with engine.begin() as conn:
            await conn.execute(sa.text("UPDATE alembic_version SET version_num = '9999'"))
    finally:
        await engine.dispose()
    with pytest.raises(HistoryUnavailable, match="revision '9999', which this version does not know"):
        await HistoryStore.open(history_url)


async def _tables(engine: AsyncEngine) -> set[str]:
    async with engine.connect() as conn:
        return set(await conn.run_sync(lambda c: sa.inspect(c).get_table_names()))


# --- errors ---------------------------------------------------------------------------------------------------

async def test_an_unreachable_postgres_is_unavailable_naming_host_and_port_quickly() -> None:
    port = free_port()  # nothing listens there
    started = time.monotonic()
    with pytest.raises(HistoryUnavailable) as caught:
        await HistoryStore.open(f"postgresql+asyncpg://trainyard:s3cret-pw@127.0.0.1:{port}/history")
    assert time.monotonic() - started < 5
    assert f"127.0.0.1:{port}" in str(caught.value) and "s3cret-pw" not in str(caught.value)


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port that accepts TCP connections and never says a word: a hung server or a dropped route."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield int(listener.getsockname()[1])


async def test_a_silent_postgres_times_out_at_the_connect_timeout(silent_server: int) -> None:
    started = time.monotonic()
    with pytest.raises(HistoryUnavailable, match=f"127.0.0.1:{silent_server}"):
        await HistoryStore.open(f"postgresql+asyncpg://trainyard:pw@127.0.0.1:{silent_server}/history",
                                connect_timeout=0.5)
    assert time.monotonic() - started < 3


async def test_a_wrong_password_is_unavailable_without_showing_it(postgres_url: str) -> None:
    url = parse_url(postgres_url).set(password="not-the-password")
    with pytest.raises(HistoryUnavailable, match="password authentication failed") as caught:
        await HistoryStore.open(url.render_as_string(hide_password=False))
    assert "not-the-password" not in str(caught.value) and "***" in str(caught.value)


@pytest.mark.parametrize(("url", "why"), [
    ("not a url", "invalid history database URL"),
    ("postgresql+asyncpg://trainyard:s3cret-pw@db:notaport/history", "invalid history database URL"),
    ("mysql://trainyard:s3cret-pw@db/history", "unsupported backend 'mysql'"),
    ("postgresql+psycopg2://trainyard:s3cret-pw@db/history", "unsupported backend"),
    ("postgresql+asyncpg://trainyard:s3cret-pw@db", "names no database"),
    ("sqlite+aiosqlite://", "SQLite needs a file"),
    ("sqlite:///:memory:", "SQLite needs a file"),
])
async def test_a_malformed_or_unsupported_url_is_a_value_error(url: str, why: str) -> None:
    with pytest.raises(ValueError, match=why) as caught:
        await HistoryStore.open(url)
    assert "s3cret-pw" not in str(caught.value)


async def test_plain_scheme_urls_get_the_async_drivers(tmp_path: Path) -> None:
    assert parse_url("postgresql://u:p@h/d").drivername == "postgresql+asyncpg"
    store = await HistoryStore.open(f"sqlite:///{tmp_path / 'h.db'}")
    try:
        assert store.engine.url.drivername == "sqlite+aiosqlite"
    finally:
        await store.close()


async def test_a_sqlite_file_in_a_missing_directory_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(HistoryUnavailable, match="does not exist"):
        await HistoryStore.open(f"sqlite+aiosqlite:///{tmp_path / 'nowhere' / 'history.db'}")


async def test_sqlite_readers_are_not_blocked_by_a_writer_and_a_writer_gives_up_after_the_timeout(
        sqlite_url: str) -> None:
    store = await HistoryStore.open(sqlite_url, query_timeout=0.3)
    await store.archive([job(1)])
    other = sqlite3.connect(parse_url(sqlite_url).database or "", isolation_level=None)  # another process
    try:
        other.execute("BEGIN IMMEDIATE")
        other.execute("DELETE FROM jobs")
        assert await store.count() == 1, "WAL: the reader sees the last commit while a writer holds the lock"
        started = time.monotonic()
        with pytest.raises(HistoryUnavailable, match="database is locked"):
            await store.archive([job(2)])
        assert 0.25 < time.monotonic() - started < 3, "waited for the lock about query_timeout"
        other.execute("ROLLBACK")
        await store.archive([job(2)])
        assert await store.count() == 2
        assert other.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    finally:
        other.close()
        await store.close()


async def test_a_postgres_outage_is_unavailable_and_the_store_recovers_after_it() -> None:
    server = postgres.start()
    try:
        store = await HistoryStore.open(server.url(), connect_timeout=1.0, query_timeout=2.0)
        try:
            await store.archive([job(1)])
            server.stop()
            with pytest.raises(HistoryUnavailable, match=f"{server.host}:{server.port}"):
                await store.archive([job(2)])
            with pytest.raises(HistoryUnavailable):
                await store.list(JobFilter(), limit=10)
            server.start()
            await store.archive([job(2)])
            assert ids(await store.list(JobFilter(), limit=10)) == [job_id(2), job_id(1)]
        finally:
            await store.close()
    finally:
        postgres.stop_and_clean(server)
