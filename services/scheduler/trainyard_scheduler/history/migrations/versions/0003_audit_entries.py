"""The audit log moves out of etcd: audit_entries.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02

Every service still appends its audit entries to etcd before it answers (trainyard_core.audit.AuditLog); the
leader moves them here (trainyard_scheduler.audit_archive) and deletes them from etcd, so etcd holds only the
entries not moved yet. See trainyard_scheduler.history.schema for the columns and indexes.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_INDEXED = ("principal", "user_name", "team", "action_name", "target", "result", "request_id")


def upgrade() -> None:
    op.create_table(
        "audit_entries",
        sa.Column("id", sa.Text().with_variant(sa.Text(collation="C"), "postgresql"), nullable=False),
        sa.Column("time", sa.Double(), nullable=False),
        *(sa.Column(name, sa.Text(), nullable=False) for name in (
            "principal", "user_name", "role", "service", "action", "action_name", "target", "team", "result",
            "message", "request_id", "detail")),
        sa.PrimaryKeyConstraint("id", name="pk_audit_entries"),
    )
    for column in _INDEXED:
        op.create_index(f"ix_audit_entries_{column}_id", "audit_entries", [column, "id"])


def downgrade() -> None:
    op.drop_table("audit_entries")  # its indexes go with it
