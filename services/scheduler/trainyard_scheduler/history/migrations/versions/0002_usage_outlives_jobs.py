"""Usage records outlive their job rows: drop usage_records' foreign key to jobs, index what pruning reads.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02

Job rows and usage records have their own retention (`history_job_retention_days`,
`history_usage_retention_days`): accounting is kept for years, like slurmdbd's PurgeUsageAfter beside its
PurgeJobAfter. In 0001 usage_records.job_id referred to jobs ON DELETE CASCADE, so deleting a job row took its
usage with it; this revision drops that constraint. Pruning reads jobs by finished_at (0001's
ix_jobs_finished_at_job_id serves it) and usage by ended_at, which had no index: ix_usage_records_ended_at.

SQLite cannot drop a constraint in place, so batch mode recreates usage_records (a copy, then a rename, inside
the migration's one transaction), keeping its WITHOUT ROWID layout. SQLite's reflection skips expression
indexes, which the copy would then lose, so ix_usage_records_duration is dropped before the copy and created
again after it. PostgreSQL drops the constraint in place; building the new index takes a SHARE lock on
usage_records for as long as that takes (archiving waits meanwhile; reads do not).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from alembic.util import CommandError

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_USAGE_FK = "fk_usage_records_job_id_jobs"
_DURATION = "ix_usage_records_duration"
_ENDED_AT = "ix_usage_records_ended_at"


def _sqlite() -> bool:
    return op.get_bind().dialect.name == "sqlite"


def _create_duration_index() -> None:
    op.create_index(_DURATION, "usage_records", [sa.text("(ended_at - started_at)")])


def upgrade() -> None:
    sqlite = _sqlite()
    if sqlite:
        op.drop_index(_DURATION, table_name="usage_records")
    with op.batch_alter_table("usage_records", table_kwargs={"sqlite_with_rowid": False}) as batch:
        batch.drop_constraint(_USAGE_FK, type_="foreignkey")
    if sqlite:
        _create_duration_index()
    op.create_index(_ENDED_AT, "usage_records", ["ended_at"])


def downgrade() -> None:
    # 0001 cannot hold a usage record whose job row is gone (pruned); those are accounting, so they are not
    # dropped on the way down: the operator decides.
    orphans = op.get_bind().execute(sa.text(
        "SELECT count(*) FROM usage_records WHERE NOT EXISTS "
        "(SELECT 1 FROM jobs WHERE jobs.job_id = usage_records.job_id)")).scalar_one()
    if orphans:
        raise CommandError(f"cannot downgrade the history database below 0002: {orphans} usage records belong to "
                           "jobs no longer in it (pruned), and the 0001 schema cannot hold them; export them, then "
                           "DELETE FROM usage_records WHERE job_id NOT IN (SELECT job_id FROM jobs)")
    sqlite = _sqlite()
    op.drop_index(_ENDED_AT, table_name="usage_records")
    if sqlite:
        op.drop_index(_DURATION, table_name="usage_records")
    with op.batch_alter_table("usage_records", table_kwargs={"sqlite_with_rowid": False}) as batch:
        batch.create_foreign_key(_USAGE_FK, "jobs", ["job_id"], ["job_id"], ondelete="CASCADE")
    if sqlite:
        _create_duration_index()
