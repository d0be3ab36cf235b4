"""Schema migrations of the history database: Alembic, configured in code (no alembic.ini).

`HistoryStore.open` calls `upgrade` on every start, so an empty database gets the schema and an older one is
brought forward; the functions here are also what an operator runs by hand when the services open with
`migrate=False`:

    python -m trainyard_scheduler.history.migrate --url-file /etc/trainyard/history-url upgrade
    python -m trainyard_scheduler.history.migrate --url-file ... current
    python -m trainyard_scheduler.history.migrate --url postgresql://db/trainyard sql   # DDL for a DBA, offline

Concurrency: scheduler replicas may start together against one empty database. Each migration run is one
transaction that first takes a lock: on PostgreSQL a transaction-scoped advisory lock (DDL is transactional
there, so a run either lands whole or not at all), on SQLite the database's write lock (BEGIN IMMEDIATE,
through the `WRITE_LOCK_OPTION` the store's engines honour). The second replica waits, then finds the schema
at head and does nothing. Within one process, runs also take turns on an asyncio lock: Alembic keeps the
running migration in module globals (`alembic.op`, `alembic.context`), so two runs interleaved on one event
loop would apply each other's operations to the wrong connection. (Runs on event loops in different threads
are not serialised; open stores from one loop, as the services do.)
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import weakref
from collections.abc import Callable
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"

# The execution option under which the store's SQLite engines open a transaction with BEGIN IMMEDIATE (take the
# write lock first) instead of BEGIN: a transaction that reads and then writes cannot be refused half-way.
WRITE_LOCK_OPTION = "trainyard_history_write"

# pg_advisory_xact_lock key: any 64-bit number no other application on the database uses ("trainyard" in hex).
_ADVISORY_LOCK_KEY = 0x747261696E79


class SchemaMismatch(RuntimeError):
    """The database's schema is not one this code can use (missing, or at a revision this version does not
    know, which a newer scheduler wrote)."""


def config(connection: Connection | None = None, *, url: str | None = None) -> Config:
    """Alembic's configuration for the history migrations; `connection` for online runs (env.py uses it),
    `url` for offline (SQL script) runs."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if url is not None:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))  # ConfigParser interpolates %
    cfg.attributes["connection"] = connection
    return cfg


def scripts() -> ScriptDirectory:
    return ScriptDirectory.from_config(config())


def head() -> str:
    """The revision this code's schema (trainyard_scheduler.history.schema) is at."""
    revision = scripts().get_current_head()
    if revision is None:  # pragma: no cover - the package ships its revisions
        raise SchemaMismatch(f"no migrations found in {MIGRATIONS_DIR}")
    return revision


def current_of(connection: Connection) -> str | None:
    """The revision the database is at (None: no history schema yet)."""
    return MigrationContext.configure(connection).get_current_revision()


async def current(engine: AsyncEngine) -> str | None:
    async with engine.connect() as conn:
        return await conn.run_sync(current_of)


async def upgrade(engine: AsyncEngine, revision: str = "head") -> None:
    """Bring the database to `revision` (idempotent: a database already there is left alone). SchemaMismatch
    if the database is at a revision this code does not know."""
    await _run_locked(engine, lambda conn: _upgrade(conn, revision))


async def downgrade(engine: AsyncEngine, revision: str) -> None:
    """Take the database back to `revision` ("base": drop everything the migrations created)."""
    await _run_locked(engine, lambda conn: command.downgrade(config(conn), revision))


def _upgrade(conn: Connection, revision: str) -> None:
    at = current_of(conn)
    if at is not None:
        try:
            scripts().get_revision(at)
        except CommandError:
            raise SchemaMismatch(f"the history database is at schema revision {at!r}, which this version does not "
                                 f"know (its newest is {head()!r}): a newer Trainyard migrated it; upgrade this "
                                 "one") from None
    command.upgrade(config(conn), revision)


_loop_locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = weakref.WeakKeyDictionary()


def _alembic_turn() -> asyncio.Lock:
    """This event loop's lock for running Alembic (see the module docstring)."""
    loop = asyncio.get_running_loop()
    lock = _loop_locks.get(loop)
    if lock is None:
        lock = _loop_locks[loop] = asyncio.Lock()
    return lock


async def _run_locked(engine: AsyncEngine, step: Callable[[Connection], None]) -> None:
    async with _alembic_turn(), engine.connect() as conn:
        conn = await conn.execution_options(**{WRITE_LOCK_OPTION: True})
        await conn.run_sync(_in_locked_transaction, step)


def _in_locked_transaction(conn: Connection, step: Callable[[Connection], None]) -> None:
    with conn.begin():
        if conn.dialect.name == "postgresql":
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": _ADVISORY_LOCK_KEY})
        step(conn)


def main(argv: list[str] | None = None) -> int:
    """The operator's command line (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m trainyard_scheduler.history.migrate",
                                     description="Migrate the scheduler's history database.")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="the database URL (visible to other users in ps; prefer --url-file)")
    where.add_argument("--url-file", type=Path, help="a file holding the database URL")
    sub = parser.add_subparsers(dest="action", required=True)
    up = sub.add_parser("upgrade", help="bring the schema to a revision (default: head)")
    up.add_argument("revision", nargs="?", default="head")
    down = sub.add_parser("downgrade", help="take the schema back to a revision (base: drop it)")
    down.add_argument("revision")
    sub.add_parser("current", help="print the database's revision and this version's head")
    sql = sub.add_parser("sql", help="print the upgrade's DDL for the URL's dialect without connecting")
    sql.add_argument("revision", nargs="?", default="head")
    args = parser.parse_args(argv)
    url = args.url if args.url is not None else args.url_file.read_text().strip()

    from .store import HistoryUnavailable, make_engine, parse_url  # the store imports this module

    try:
        parsed = parse_url(url)
        if args.action == "sql":
            command.upgrade(config(url=parsed.render_as_string(hide_password=False)), args.revision,
                            sql=True)
            return 0
        return asyncio.run(_online(make_engine(parsed), args.action, args.revision if "revision" in args else ""))
    except (ValueError, HistoryUnavailable, SchemaMismatch, CommandError) as exc:
        print(f"error: {exc}", file=sys.stderr)  # the messages name the database, its password masked
        return 1


async def _online(engine: AsyncEngine, action: str, revision: str) -> int:
    from .store import translate_errors

    what = {"upgrade": "upgrade the schema", "downgrade": "downgrade the schema", "current": "read the schema revision"}
    try:
        async with translate_errors(what[action], engine.url):
            if action == "upgrade":
                await upgrade(engine, revision)
            elif action == "downgrade":
                await downgrade(engine, revision)
            print(f"database at {await current(engine) or 'base (empty)'}; this version's head is {head()}")
        return 0
    finally:
        await engine.dispose()


if __name__ == "__main__":
    # Run the module's importable copy, not this __main__ one, so that its exceptions are the store's.
    from trainyard_scheduler.history import migrate as _importable

    sys.exit(_importable.main())
