"""Vacuum jobs and job_labels every 10,000 archived rows, whatever their size (PostgreSQL only).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02

`HistoryStore.list` reads ids from covering indexes (store._page_query) and fetches only the page's rows. On
PostgreSQL an index-only read skips the table for a row only on a page the visibility map marks all-visible,
which only VACUUM does; on any other page every index entry read costs a read of the table, which is far
larger than the server's cache. Autovacuum by default vacuums an insert-only table once 20% more rows have
been inserted since its last vacuum (autovacuum_vacuum_insert_scale_factor 0.2), so a store of 1,000,000
jobs kept up to 200,000 of its newest rows, the ones newest-first pages and recent time windows read, out of
the map. Measured on 1,000,000 jobs filled as bench/history.py fills them (the newest 110,000 rows not
all-visible), from a cold cache: a day's window of one team read about 4,300 table pages, p95 270-300 ms;
once autovacuum had run with the settings below, 32-37 ms, and the whole mix's p95 went from 52-68 ms to
33-40 ms (the same queries; no query changed).

So these two tables are vacuumed once 10,000 rows were inserted since the last vacuum (scale factor 0): the
rows out of the map stay a few minutes of archiving whatever the store's size. Such a vacuum is cheap: it
reads only the pages not yet all-visible and, with no dead rows, skips the indexes. usage_records is read by
its primary key (rows, not index-only) and keeps the server's defaults.

Storage parameters are PostgreSQL's; SQLite has no visibility map (this revision does nothing there). The
insert-triggered autovacuum exists from PostgreSQL 13; an older server (none supported upstream) is left as it
is. Offline (`sql`), the statements are printed for the DBA as they are.
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_TABLES = ("jobs", "job_labels")
_SETTINGS = {"autovacuum_vacuum_insert_threshold": "10000", "autovacuum_vacuum_insert_scale_factor": "0"}


def _applies() -> bool:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return False
    if op.get_context().as_sql:
        return True
    return int(bind.exec_driver_sql("SHOW server_version_num").scalar_one()) >= 130000


def upgrade() -> None:
    if not _applies():
        return
    settings = ", ".join(f"{name} = {value}" for name, value in _SETTINGS.items())
    for table in _TABLES:
        op.execute(f"ALTER TABLE {table} SET ({settings})")


def downgrade() -> None:
    if not _applies():
        return
    for table in _TABLES:
        op.execute(f"ALTER TABLE {table} RESET ({', '.join(_SETTINGS)})")
