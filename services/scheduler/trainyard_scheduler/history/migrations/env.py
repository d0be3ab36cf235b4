"""Alembic's entry point for the history database, run by trainyard_scheduler.history.migrate.

Online, the caller hands over a connection already inside a transaction (and, on PostgreSQL, holding the
migration advisory lock) as `config.attributes["connection"]`: the migrations run in that transaction, so that
several scheduler replicas opening one database at once migrate it exactly once. There is no alembic.ini and no
engine is made here; a URL alone is only for offline mode (`--sql`), which prints the DDL for a DBA to run.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy.engine import Connection

from trainyard_scheduler.history.schema import metadata


def run_offline() -> None:
    context.configure(url=context.config.get_main_option("sqlalchemy.url"), target_metadata=metadata,
                      literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def run_online(connection: Connection) -> None:
    # render_as_batch: SQLite cannot ALTER most things in place; batch mode recreates the table instead.
    context.configure(connection=connection, target_metadata=metadata, render_as_batch=True,
                      compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_offline()
else:
    conn = context.config.attributes.get("connection")
    if not isinstance(conn, Connection):
        raise RuntimeError("run the history migrations through trainyard_scheduler.history.migrate, which passes "
                           "a connection in config.attributes['connection']")
    run_online(conn)
