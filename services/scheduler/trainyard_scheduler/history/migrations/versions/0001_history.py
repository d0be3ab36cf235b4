"""The history store's first schema: jobs, job_labels, usage_records and their indexes.

Revision ID: 0001
Revises:
Create Date: 2026-12-01

See trainyard_scheduler.history.schema for why each column and index is as it is (user_name, COLLATE "C" on
PostgreSQL for the ordered columns, double-precision unix seconds).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _ordered_text() -> sa.types.TypeEngine[str]:
    return sa.Text().with_variant(sa.Text(collation="C"), "postgresql")


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("job_id", _ordered_text(), nullable=False),
        sa.Column("team", sa.Text(), nullable=False),
        sa.Column("user_name", sa.Text(), nullable=False),
        sa.Column("name", _ordered_text(), nullable=False),
        sa.Column("queue", sa.Text(), nullable=False),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("submitted_at", sa.Double(), nullable=False),
        sa.Column("finished_at", sa.Double(), nullable=False),
        sa.Column("archived_at", sa.Double(), nullable=False),
        sa.Column("record", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", name="pk_jobs"),
    )
    for name, columns in [
        ("ix_jobs_team_job_id", ["team", "job_id"]),
        ("ix_jobs_team_state_job_id", ["team", "state", "job_id"]),
        ("ix_jobs_user_name_job_id", ["user_name", "job_id"]),
        ("ix_jobs_state_job_id", ["state", "job_id"]),
        ("ix_jobs_queue_job_id", ["queue", "job_id"]),
        ("ix_jobs_name_job_id", ["name", "job_id"]),
        ("ix_jobs_team_name_job_id", ["team", "name", "job_id"]),
        ("ix_jobs_submitted_at_job_id", ["submitted_at", "job_id"]),
        ("ix_jobs_team_submitted_at_job_id", ["team", "submitted_at", "job_id"]),
        ("ix_jobs_finished_at_job_id", ["finished_at", "job_id"]),
        ("ix_jobs_team_finished_at_job_id", ["team", "finished_at", "job_id"]),
    ]:
        op.create_index(name, "jobs", columns)

    op.create_table(
        "job_labels",
        sa.Column("job_id", _ordered_text(), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("value", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "key", name="pk_job_labels"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.job_id"], name="fk_job_labels_job_id_jobs", ondelete="CASCADE"),
        sqlite_with_rowid=False,
    )
    op.create_index("ix_job_labels_key_value_job_id", "job_labels", ["key", "value", "job_id"])

    op.create_table(
        "usage_records",
        sa.Column("job_id", _ordered_text(), nullable=False),
        sa.Column("attempt", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("team", sa.Text(), nullable=False),
        sa.Column("user_name", sa.Text(), nullable=False),
        sa.Column("project", sa.Text(), nullable=False),
        sa.Column("queue", sa.Text(), nullable=False),
        sa.Column("accelerator_model", sa.Text(), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("cpus", sa.Integer(), nullable=False),
        sa.Column("nodes", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.Double(), nullable=False),
        sa.Column("ended_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "attempt", name="pk_usage_records"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.job_id"], name="fk_usage_records_job_id_jobs",
                                ondelete="CASCADE"),
        sqlite_with_rowid=False,
    )
    op.create_index("ix_usage_records_team_started_at", "usage_records", ["team", "started_at"])
    op.create_index("ix_usage_records_started_at", "usage_records", ["started_at"])
    op.create_index("ix_usage_records_duration", "usage_records", [sa.text("(ended_at - started_at)")])


def downgrade() -> None:
    op.drop_table("usage_records")
    op.drop_table("job_labels")
    op.drop_table("jobs")
