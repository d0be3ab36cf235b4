"""The scheduler's history store: finished jobs and their usage records, in SQL, once they leave etcd.

etcd holds what the scheduler acts on; a job that reached a terminal state is only ever read again, and
keeping every finished job there would grow the keyspace (and every snapshot) without bound. The leader
archives finished jobs here, then deletes them from etcd. PostgreSQL in production, SQLite (a file beside the
scheduler) as the embedded default; the same statements run on both.

Contracts:

- `archive` is one transaction and idempotent by job id: the leader may crash between this write and the etcd
  delete and archive the same jobs again. A job's row and labels are replaced by the latest archive; its usage
  records are upserted by (job_id, attempt), the latest values winning. Usage is accounting, so a record is
  never removed by a later archive that happens to omit it.
- Reads are consistent snapshots (one transaction at REPEATABLE READ on PostgreSQL; a WAL read transaction on
  SQLite): a job never comes back with labels from one archive and a row from another.
- `list` pages newest first by job id (ids sort by submission time) with a keyset (`before`), so pages stay
  stable while newer jobs are archived between them.
- `prune` deletes what is older than the caller's cutoffs (job rows with their labels by `finished_at`, usage
  records by `ended_at`, on their own schedules: usage outlives the job rows), a bounded batch per short
  transaction, so a large prune never holds a lock for long and archiving interleaves with it.
- Failures that retrying later can fix (the database is down, locked, restarting, timed out, or lacks the
  schema) raise `HistoryUnavailable`, whose message names the database with its password masked. Anything
  else (a bug: a constraint this code should never violate) propagates as SQLAlchemy raised it.

SQLite specifics: WAL journal (readers never block the writer, and several scheduler replicas on one machine
may open the same file), a busy timeout (a writer waits for the lock rather than failing at once), foreign keys
on, synchronous=FULL (the leader deletes a job from etcd once its archive commits, so a commit must survive a
power loss). Write transactions take the write lock up front (BEGIN IMMEDIATE).
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import sqlalchemy as sa
from alembic.util import CommandError
from sqlalchemy import event, exc
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from ..domain.listing import JobFilter as JobFilter
from . import migrate as migrations
from .audit_store import AuditTable
from .schema import job_labels, jobs, usage_records

# The drivers the store runs on, and what a URL without a driver means.
_ASYNC_DRIVERS = {"postgresql": "postgresql+asyncpg", "postgresql+asyncpg": "postgresql+asyncpg",
                  "sqlite": "sqlite+aiosqlite", "sqlite+aiosqlite": "sqlite+aiosqlite"}
# Ids per IN (...) list: far below both backends' limit on bound parameters (32766 and 32767).
_IN_CHUNK = 5000
# PostgreSQL SQLSTATE classes that mean "the database cannot be used now", which a retry can outlive once the
# server or its operator has done their part: connection exception, invalid authorization (a password being
# rotated), invalid catalog name (the database not created yet), transaction rollback (serialization failure,
# deadlock), insufficient resources, operator intervention (shutdown, statement timeout), system error; and
# 42P01/42703, an undefined table or column: a schema that is missing or behind, fixed by migrating.
_TRANSIENT_SQLSTATE_CLASSES = ("08", "28", "3D", "40", "53", "57", "58")
_SCHEMA_SQLSTATES = ("42P01", "42703")


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """One allocation: one attempt of a job that was placed, from its start to its end."""

    job_id: str
    attempt: int
    team: str
    user: str
    project: str  # the job's "project" label, "" if none
    queue: str
    accelerator_model: str  # "" for CPU-only
    gpus: int
    cpus: int
    nodes: int
    started_at: float  # unix seconds
    ended_at: float

    @property
    def key(self) -> UsageKey:
        """Where the record is in the order `HistoryStore.usage` answers in (`after` of the next page)."""
        return UsageKey(self.started_at, self.job_id, self.attempt)


class UsageKey(NamedTuple):
    started_at: float
    job_id: str
    attempt: int


@dataclass(frozen=True, slots=True)
class ArchivedJob:
    """A finished job as archived. `record` is the scheduler's own encoding of the whole job (opaque bytes,
    stored as they are); the other fields are what the store filters on."""

    job_id: str  # job ids sort by submission time (lexicographic order == submission order)
    team: str
    user: str
    name: str
    queue: str
    state: str  # a terminal state's value: "succeeded" | "failed" | "cancelled"
    labels: Mapping[str, str]
    submitted_at: float
    finished_at: float
    record: bytes
    usage: tuple[UsageRecord, ...] = ()


class Pruned(NamedTuple):
    """What one `prune` deleted: job rows (each with its labels) and usage records."""

    jobs: int
    usage: int


class HistoryUnavailable(Exception):
    """The history database cannot be used now (unreachable, locked, restarting, timed out, schema missing or
    from another version); the message says which. The caller keeps what it meant to archive and retries."""


def mask_url(url: str | URL) -> str:
    """`url` with its password replaced by ***, for messages and logs; also for strings that do not parse."""
    if isinstance(url, URL):
        return url.render_as_string(hide_password=True)
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (exc.ArgumentError, ValueError, TypeError):
        return re.sub(r"(//[^/:@]*:)[^@/]*@", r"\1***@", url)


def parse_url(url: str) -> URL:
    """The URL with its async driver (postgresql:// means asyncpg, sqlite:// aiosqlite); ValueError, naming
    the URL with its password masked, if it is malformed or names a database the store does not run on."""
    try:
        parsed = make_url(url)
    except (exc.ArgumentError, ValueError, TypeError) as e:
        raise ValueError(f"invalid history database URL {mask_url(url)!r}: {e}") from None
    driver = _ASYNC_DRIVERS.get(parsed.drivername)
    if driver is None:
        raise ValueError(f"history database URL {mask_url(parsed)!r}: unsupported backend {parsed.drivername!r}; "
                         "use postgresql+asyncpg://user:password@host:port/database or sqlite+aiosqlite:///path")
    parsed = parsed.set(drivername=driver)
    if driver.startswith("sqlite") and parsed.database in (None, "", ":memory:"):
        raise ValueError(f"history database URL {mask_url(parsed)!r}: SQLite needs a file (sqlite:///path/to/file"
                         "); an in-memory database would be private to one connection and lost on close")
    if driver.startswith("postgresql") and not parsed.database:
        raise ValueError(f"history database URL {mask_url(parsed)!r} names no database")
    return parsed


def _enter_wal(cursor: Any, busy_ms: int) -> None:
    """PRAGMA journal_mode=WAL, retried while another process holds the lock it needs.

    Switching a new database to WAL takes an exclusive lock, and SQLite answers SQLITE_BUSY at once instead of
    calling the busy handler when another connection is switching it or recovering its WAL (two replicas opening
    an empty database together: seen as "database is locked" on one of them). Once one switched, the pragma is a
    no-op for the rest; so wait and retry, for at most the busy timeout. Only a contended first open waits here."""
    deadline = time.monotonic() + busy_ms / 1000
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except Exception as error:  # the driver's OperationalError, through the async adapter
            if "locked" not in str(error) or time.monotonic() >= deadline:
                raise
            time.sleep(0.01)


def make_engine(url: URL, *, connect_timeout: float = 5.0, query_timeout: float = 30.0) -> AsyncEngine:
    """The async engine the store (and `migrate`) use for `url` (from `parse_url`). Connecting is bounded by
    `connect_timeout`; a statement by `query_timeout`: on PostgreSQL the time it may run, on SQLite the time
    it may wait for another process's write lock (the busy timeout)."""
    if url.get_backend_name() == "postgresql":
        return create_async_engine(
            url, pool_size=5, max_overflow=5, pool_timeout=query_timeout,
            # A pooled connection may have died with a server restart or failover; test it at checkout.
            pool_pre_ping=True,
            connect_args={"timeout": connect_timeout, "command_timeout": query_timeout,
                          "server_settings": {"application_name": "trainyard-history"}})
    engine = create_async_engine(url, connect_args={"timeout": query_timeout})
    busy_ms = int(query_timeout * 1000)

    @event.listens_for(engine.sync_engine, "connect")
    def _configure(dbapi_connection: Any, _record: Any) -> None:
        # The driver's own transaction handling (BEGIN only before DML, never before a SELECT) would give reads
        # no snapshot and writes no early lock; with it off, _begin below opens every transaction.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        for pragma in (f"busy_timeout={busy_ms}", "foreign_keys=ON", "synchronous=FULL"):
            cursor.execute(f"PRAGMA {pragma}")
        _enter_wal(cursor, busy_ms)
        cursor.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _begin(conn: sa.Connection) -> None:
        write = conn.get_execution_options().get(migrations.WRITE_LOCK_OPTION, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


def _transient(error: exc.DBAPIError) -> bool:
    if error.connection_invalidated or isinstance(error, exc.OperationalError | exc.InterfaceError):
        return True
    sqlstate = getattr(error.orig, "sqlstate", None) or ""
    return sqlstate.startswith(_TRANSIENT_SQLSTATE_CLASSES) or sqlstate in _SCHEMA_SQLSTATES


def _reason(error: BaseException) -> str:
    cause = error.orig if isinstance(error, exc.DBAPIError) and error.orig is not None else error
    text = str(cause).strip() or type(cause).__name__
    return text.splitlines()[0] if isinstance(error, exc.DBAPIError) else text


@contextlib.asynccontextmanager
async def translate_errors(what: str, url: URL) -> AsyncIterator[None]:
    """Turn the failures a retry can outlive into HistoryUnavailable naming `what`, the host and port, and the
    URL with its password masked."""
    where = f"{url.host}:{url.port or 5432}" if url.get_backend_name() == "postgresql" else f"{url.database}"
    try:
        yield
    except exc.DBAPIError as e:
        if not _transient(e):
            raise
        raise HistoryUnavailable(f"{what}: history database at {where} ({mask_url(url)}): {_reason(e)}") from e
    except (OSError, TimeoutError, migrations.SchemaMismatch, CommandError) as e:
        raise HistoryUnavailable(f"{what}: history database at {where} ({mask_url(url)}): {_reason(e)}") from e


def _check_sqlite_directory(url: URL) -> None:
    """SQLite creates a missing file but not a missing directory, and then only says "unable to open"."""
    if url.get_backend_name() == "sqlite":
        directory = Path(url.database or "").expanduser().resolve().parent
        if not directory.is_dir():
            raise HistoryUnavailable(f"history database {mask_url(url)}: directory {directory} does not exist")


def _prefix_upper_bound(prefix: str) -> str | None:
    """The least string above every string that starts with `prefix`, in code-point order (None: no bound).
    `name >= prefix AND name < bound` is then exactly "starts with prefix", and an index range scan."""
    chars = list(prefix)
    while chars:
        last = ord(chars.pop())
        if last < 0x10FFFF:
            nxt = last + 1
            if 0xD800 <= nxt <= 0xDFFF:  # surrogates are not text; neither backend stores them
                nxt = 0xE000
            return "".join(chars) + chr(nxt)
    return None


# How `list` makes one page fast on both backends (measured on 1,000,000 jobs; SQLite's planner has no useful
# statistics and PostgreSQL's assumes that rows matching a time range are spread evenly along job_id order, which
# is false: ids follow submission time). A page is "newest first, LIMIT n", which an index ending in job_id
# serves by walking backwards and stopping after n matches: cheap when matches are dense among the newest
# rows, hopeless when they are rare or all old. For the filters whose selectivity varies by orders of magnitude
# (a label, a name prefix, a time range with an upper bound), a bounded count over their own index first says
# whether few rows match (at most the cap, so the count costs at most cap index entries):
# - few: that index drives. A label's job ids become an IN list the page is read from; a name or time range
#   is read whole and sorted (ORDER BY an expression, so that no planner prefers walking job_id order
#   through the whole table hoping to meet the range early);
# - many: the filter is a plain check on rows an ordered walk meets (a label as EXISTS; a range compared
#   through an expression no index serves, so no planner reads and sorts the huge range).
# The page's job ids are selected first (from covering indexes where the filters allow) and only those rows are
# fetched. On PostgreSQL that read skips the table only for rows on pages VACUUM has marked all-visible; every
# other index entry read costs a table read (4,300 for a team's day, 220-300 ms from a cold cache), so the
# store's tables are vacuumed every 10,000 archived rows (migration 0004) rather than every 20% of the table,
# which left the newest rows, the ones these pages read most, out of the visibility map. Other shapes were
# measured and dropped: a label walked newest first with a lookup per job id wins only where the rows are not
# all-visible, and loses to the merge join the planner picks where they are. What stays slow: an upper time
# bound far in the past with more than the cap of jobs before it and many after it (everything newer is walked
# past); page by `before` (ids sort by submission time) for that.
_LABEL_DRIVER_CAP = 10_000
_RANGE_DRIVER_CAP = 50_000


def _opaque(column: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
    """`column` combined with its neutral element (`|| ''` for text, `+ 0` for numbers): the same values and
    order, but an expression that no index serves."""
    if isinstance(column.type, sa.String):
        return column.op("||")(sa.literal_column("''"))
    return column + sa.literal_column("0")


async def _few(conn: AsyncConnection, query: sa.Select[Any], cap: int) -> bool:
    """Whether `query` has fewer than `cap` rows, reading at most `cap` of them."""
    probe = sa.select(sa.func.count()).select_from(query.limit(cap).subquery())
    return int((await conn.execute(probe)).scalar_one()) < cap


def _range(column: sa.ColumnElement[Any], low: Any, high: Any) -> list[sa.ColumnElement[bool]]:
    """low <= column < high, either bound None for none."""
    return ([column >= low] if low is not None else []) + ([column < high] if high is not None else [])


async def _page_query(conn: AsyncConnection, flt: JobFilter, limit: int, before: str) -> sa.Select[Any]:
    """The rows of one page of `list` (see the comment above for why it is built this way)."""
    c, lab = jobs.c, job_labels.c
    where: list[sa.ColumnElement[bool]] = [column == wanted for column, wanted in (
        (c.team, flt.team), (c.user_name, flt.user), (c.queue, flt.queue)) if wanted]
    if flt.states:
        where.append(c.state.in_(sorted(flt.states)))
    if before:
        where.append(c.job_id < before)
    driven_by_label = sort_driven = False
    for key, value in sorted(flt.labels.items()):
        pair = (lab.key == key, lab.value == value)
        # The keyset bound again on the label's side: no planner infers it through the join.
        below = (lab.job_id < before,) if before else ()
        if not driven_by_label and await _few(conn, sa.select(lab.job_id).where(*pair), _LABEL_DRIVER_CAP):
            where.append(c.job_id.in_(sa.select(lab.job_id).where(*pair, *below)))
            driven_by_label = True
        else:
            where.append(sa.exists().where(lab.job_id == c.job_id, *pair, *below))
    team = (c.team == flt.team,) if flt.team else ()
    ranges: list[tuple[sa.ColumnElement[Any], Any, Any]] = [
        (c.submitted_at, flt.submitted_after, flt.submitted_before),
        (c.finished_at, flt.finished_after, flt.finished_before)]
    if flt.name_prefix:
        ranges.append((c.name, flt.name_prefix, _prefix_upper_bound(flt.name_prefix)))
    for column, low, high in ranges:
        if low is None and high is None:
            continue
        if high is None and column is not c.name:
            # A time range open towards the present matches the newest jobs first: the walk meets them at once.
            where += _range(column, low, high)
        elif await _few(conn, sa.select(column).where(*team, *_range(column, low, high)).order_by(column),
                        _RANGE_DRIVER_CAP):
            where += _range(column, low, high)
            sort_driven = True
        else:
            where += _range(_opaque(column), low, high)
    order = _opaque(c.job_id) if sort_driven else c.job_id
    page_ids = sa.select(c.job_id).where(*where).order_by(order.desc()).limit(limit)
    return sa.select(jobs).where(c.job_id.in_(page_ids)).order_by(c.job_id.desc())


def _chunks(items: Sequence[str]) -> Iterable[Sequence[str]]:
    for start in range(0, len(items), _IN_CHUNK):
        yield items[start:start + _IN_CHUNK]


def _usage_of(row: sa.Row[Any]) -> UsageRecord:
    m = row._mapping
    return UsageRecord(job_id=m["job_id"], attempt=m["attempt"], team=m["team"], user=m["user_name"],
                       project=m["project"], queue=m["queue"], accelerator_model=m["accelerator_model"],
                       gpus=m["gpus"], cpus=m["cpus"], nodes=m["nodes"], started_at=m["started_at"],
                       ended_at=m["ended_at"])


def _usage_row(u: UsageRecord) -> dict[str, Any]:
    return {"job_id": u.job_id, "attempt": u.attempt, "team": u.team, "user_name": u.user, "project": u.project,
            "queue": u.queue, "accelerator_model": u.accelerator_model, "gpus": u.gpus, "cpus": u.cpus,
            "nodes": u.nodes, "started_at": u.started_at, "ended_at": u.ended_at}


def _job_row(j: ArchivedJob, archived_at: float) -> dict[str, Any]:
    return {"job_id": j.job_id, "team": j.team, "user_name": j.user, "name": j.name, "queue": j.queue,
            "state": j.state, "submitted_at": j.submitted_at, "finished_at": j.finished_at,
            "archived_at": archived_at, "record": bytes(j.record)}


def _validated(batch: Sequence[ArchivedJob]) -> list[ArchivedJob]:
    """The batch by job id (sorted: every writer locks rows in one order, so two never deadlock; a job given
    twice counts once, the later one), after checking what the database would otherwise refuse half-way."""
    by_id: dict[str, ArchivedJob] = {}
    for job in batch:
        if not job.job_id:
            raise ValueError("an archived job needs a job_id")
        for u in job.usage:
            if u.job_id != job.job_id:
                raise ValueError(f"usage record of job {u.job_id!r} given with job {job.job_id!r}")
        by_id[job.job_id] = job
    return [by_id[k] for k in sorted(by_id)]


# Spelled out here because HistoryStore.list shadows the builtin inside the class body.
_Jobs = list[ArchivedJob]
_Usage = list[UsageRecord]


class HistoryStore:
    """Finished jobs and usage records in SQL. Safe for concurrent use by many tasks (a connection pool);
    `open` it once per process and `close` it on shutdown."""

    def __init__(self, engine: AsyncEngine, *, clock: Callable[[], float] = time.time) -> None:
        self._engine = engine
        self._url = engine.url
        self._postgres = engine.dialect.name == "postgresql"
        self._clock = clock
        # The audit log's table (audit_store.py), in the same database and transactions.
        self.audit = AuditTable(self._read, self._write, postgres=self._postgres)

    @classmethod
    async def open(cls, url: str, *, migrate: bool = True, connect_timeout: float = 5.0,
                   query_timeout: float = 30.0, clock: Callable[[], float] = time.time) -> HistoryStore:
        """Connect to `url` and, with `migrate`, bring its schema to this version's head (an empty database gets
        the schema; several processes may do this at once). Without `migrate` the schema must already be at
        head. ValueError: a malformed or unsupported URL. HistoryUnavailable: the database cannot be reached
        within `connect_timeout` or its schema is unusable. `query_timeout`: see `make_engine`. `clock` stamps
        `archived_at`."""
        parsed = parse_url(url)
        _check_sqlite_directory(parsed)
        engine = make_engine(parsed, connect_timeout=connect_timeout, query_timeout=query_timeout)
        store = cls(engine, clock=clock)
        try:
            async with translate_errors("open", parsed):
                if migrate:
                    await migrations.upgrade(engine)
                else:
                    await store._check_schema()
        except BaseException:
            await engine.dispose()
            raise
        return store

    async def _check_schema(self) -> None:
        at, head = await migrations.current(self._engine), migrations.head()
        if at != head:
            raise migrations.SchemaMismatch(
                f"the schema is at revision {at or 'none (empty database)'}, this version needs {head}; open with "
                "migrate=True or run `python -m trainyard_scheduler.history.migrate upgrade`")

    @property
    def engine(self) -> AsyncEngine:
        return self._engine

    async def close(self) -> None:
        """Close every pooled connection. (No ANALYZE on SQLite: the queries do not rely on planner statistics,
        see _page_query, and a full ANALYZE of a large file would hold up shutdown for seconds.)"""
        await self._engine.dispose()

    @contextlib.asynccontextmanager
    async def _read(self, what: str) -> AsyncIterator[AsyncConnection]:
        async with translate_errors(what, self._url), self._engine.connect() as conn:
            if self._postgres:
                conn = await conn.execution_options(isolation_level="REPEATABLE READ")
            async with conn.begin():
                yield conn

    @contextlib.asynccontextmanager
    async def _write(self, what: str) -> AsyncIterator[AsyncConnection]:
        async with translate_errors(what, self._url), self._engine.connect() as conn:
            conn = await conn.execution_options(**{migrations.WRITE_LOCK_OPTION: True})
            async with conn.begin():
                yield conn

    def _upsert(self, table: sa.Table, keys: Sequence[str]) -> sa.Insert:
        """INSERT .. ON CONFLICT (keys) DO UPDATE SET every other column to the new row's value."""
        if self._postgres:
            pg = postgresql.insert(table)
            return pg.on_conflict_do_update(index_elements=list(keys), set_={
                c.name: pg.excluded[c.name] for c in table.c if c.name not in keys})
        lite = sqlite.insert(table)
        return lite.on_conflict_do_update(index_elements=list(keys), set_={
            c.name: lite.excluded[c.name] for c in table.c if c.name not in keys})

    async def archive(self, jobs_: Sequence[ArchivedJob]) -> None:
        """Store `jobs_` in one transaction, replacing what an earlier archive of the same job ids stored (see
        the module docstring). An empty batch does nothing."""
        batch = _validated(jobs_)
        if not batch:
            return
        archived_at = self._clock()
        usage = {(u.job_id, u.attempt): u for j in batch for u in j.usage}
        labels = [{"job_id": j.job_id, "key": k, "value": v} for j in batch for k, v in sorted(j.labels.items())]
        async with self._write(f"archive {len(batch)} jobs") as conn:
            await conn.execute(self._upsert(jobs, ["job_id"]), [_job_row(j, archived_at) for j in batch])
            await conn.execute(sa.delete(job_labels).where(job_labels.c.job_id == sa.bindparam("old")),
                               [{"old": j.job_id} for j in batch])
            if labels:
                await conn.execute(sa.insert(job_labels), labels)
            if usage:
                await conn.execute(self._upsert(usage_records, ["job_id", "attempt"]),
                                   [_usage_row(usage[k]) for k in sorted(usage)])

    async def get(self, job_id: str) -> ArchivedJob | None:
        async with self._read(f"get job {job_id}") as conn:
            rows = (await conn.execute(sa.select(jobs).where(jobs.c.job_id == job_id))).all()
            found = await self._assemble(conn, rows)
        return found[0] if found else None

    async def list(self, flt: JobFilter, *, limit: int, before: str = "") -> _Jobs:
        """Up to `limit` jobs matching `flt`, newest first (job id descending); with `before`, only jobs whose
        id sorts below it: pass the last id of a page to get the next one. The filter is the scheduler's
        listing filter (domain.listing), the same the live jobs in etcd are matched with."""
        if limit < 1:
            raise ValueError(f"limit must be at least 1, not {limit}")
        async with self._read("list jobs") as conn:
            query = await _page_query(conn, flt, limit, before)
            return await self._assemble(conn, (await conn.execute(query)).all())

    async def usage(self, *, team: str = "", since: float | None = None, until: float | None = None,
                    limit: int = 10_000, after: UsageKey | None = None) -> _Usage:
        """Usage records that overlap [since, until) (started before `until`, ended after `since`), of `team`
        if given, in order of start (then job id and attempt), at most `limit`. With `after` (the `key` of the
        last record of a page), only the records that sort after it: the next page."""
        if limit < 1:
            raise ValueError(f"limit must be at least 1, not {limit}")
        u = usage_records.c
        where = [u.team == team] if team else []
        if until is not None:
            where.append(u.started_at < until)
        if after is not None:
            where.append(sa.tuple_(u.started_at, u.job_id, u.attempt) > sa.tuple_(*after))
        async with self._read("query usage") as conn:
            if since is not None:
                # See ix_usage_records_duration in schema.py; the second of slack absorbs the rounding of
                # ended_at - started_at.
                longest = (await conn.execute(sa.select(sa.func.max(u.ended_at - u.started_at)))).scalar()
                if longest is None:
                    return []
                where += [u.ended_at > since, u.started_at >= since - float(longest) - 1.0]
            query = sa.select(usage_records).where(*where).order_by(u.started_at, u.job_id, u.attempt).limit(limit)
            return [_usage_of(row) for row in (await conn.execute(query)).all()]

    async def prune(self, *, jobs_before: float | None, usage_before: float | None, batch: int = 1000,
                    max_batches: int | None = None) -> Pruned:
        """Delete the jobs that finished before `jobs_before` (their rows and labels; their usage records stay)
        and the usage records that ended before `usage_before`; None: that kind is kept. Both bounds are
        exclusive: a row stamped exactly at the cutoff stays. Returns how many of each were deleted.

        Oldest first, `batch` rows per transaction (each one short: a prune of millions of rows never holds a
        lock for long, and archives interleave with it), until a batch comes back short, or after
        `max_batches` transactions of each kind (None: no limit), when what is left waits for the next call.
        Idempotent, and safe beside archiving: a job archived again after it was pruned is simply stored
        again. HistoryUnavailable as the other methods; the batches committed before the failure stay
        deleted."""
        if batch < 1:
            raise ValueError(f"batch must be at least 1, not {batch}")
        if max_batches is not None and max_batches < 1:
            raise ValueError(f"max_batches must be at least 1 (or None), not {max_batches}")
        jobs_deleted = usage_deleted = 0
        if jobs_before is not None:
            jobs_deleted = await self._in_batches(f"prune jobs finished before {jobs_before}", batch, max_batches,
                                                  lambda conn: self._prune_jobs(conn, jobs_before, batch))
        if usage_before is not None:
            usage_deleted = await self._in_batches(f"prune usage ended before {usage_before}", batch, max_batches,
                                                   lambda conn: self._prune_usage(conn, usage_before, batch))
        return Pruned(jobs_deleted, usage_deleted)

    async def _in_batches(self, what: str, batch: int, max_batches: int | None,
                          one: Callable[[AsyncConnection], Awaitable[int]]) -> int:
        deleted = done = 0
        while max_batches is None or done < max_batches:
            async with self._write(what) as conn:
                n = await one(conn)
            deleted += n
            done += 1
            if n < batch:
                break
        return deleted

    @staticmethod
    async def _prune_jobs(conn: AsyncConnection, before: float, batch: int) -> int:
        c = jobs.c
        # The oldest first, through ix_jobs_finished_at_job_id. The outer finished_at test again: on PostgreSQL
        # a row re-archived (with a later end) after the subquery read it is re-checked as it is now.
        oldest = sa.select(c.job_id).where(c.finished_at < before).order_by(c.finished_at, c.job_id).limit(batch)
        gone = (await conn.execute(sa.delete(jobs).where(c.job_id.in_(oldest), c.finished_at < before)
                                   .returning(c.job_id))).scalars().all()
        # The schema's ON DELETE CASCADE has dropped the labels already where foreign keys are enforced; this
        # does not depend on it.
        for chunk in _chunks(gone):
            await conn.execute(sa.delete(job_labels).where(job_labels.c.job_id.in_(chunk)))
        return len(gone)

    @staticmethod
    async def _prune_usage(conn: AsyncConnection, before: float, batch: int) -> int:
        u = usage_records.c
        oldest = sa.select(u.job_id, u.attempt).where(u.ended_at < before).order_by(u.ended_at).limit(batch)
        result = await conn.execute(sa.delete(usage_records).where(sa.tuple_(u.job_id, u.attempt).in_(oldest),
                                                                   u.ended_at < before))
        return int(result.rowcount)

    async def count(self) -> int:
        """How many jobs are archived."""
        async with self._read("count jobs") as conn:
            return int((await conn.execute(sa.select(sa.func.count()).select_from(jobs))).scalar_one())

    async def _assemble(self, conn: AsyncConnection, rows: Sequence[sa.Row[Any]]) -> _Jobs:
        """ArchivedJobs for job rows, in their order, with their labels and usage (two queries per chunk of ids,
        in the caller's transaction)."""
        ids = [row.job_id for row in rows]
        labels: dict[str, dict[str, str]] = {i: {} for i in ids}
        usage: dict[str, list[UsageRecord]] = {i: [] for i in ids}
        for chunk in _chunks(ids):
            for label in await conn.execute(sa.select(job_labels).where(job_labels.c.job_id.in_(chunk))):
                labels[label.job_id][label.key] = label.value
            query = (sa.select(usage_records).where(usage_records.c.job_id.in_(chunk))
                     .order_by(usage_records.c.job_id, usage_records.c.attempt))
            for record in await conn.execute(query):
                usage[record.job_id].append(_usage_of(record))
        return [ArchivedJob(job_id=r.job_id, team=r.team, user=r.user_name, name=r.name, queue=r.queue,
                            state=r.state, labels=labels[r.job_id], submitted_at=r.submitted_at,
                            finished_at=r.finished_at, record=bytes(r.record), usage=tuple(usage[r.job_id]))
                for r in rows]
