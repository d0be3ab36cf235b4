"""An index for a queue's jobs in given states: (queue, state, job_id).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02

"A queue's cancelled jobs, newest first" had two indexes to choose from, (queue, job_id) and (state, job_id),
neither of which narrows it alone: a walk of either reads past every newest row that matches only its own
column (the table, for the other column, at each one), and a bitmap of both sorts every row either selects.
Which of those the planner picks depends on how the two columns' values lie in time, so the cost did too: on
1,000,000 jobs (PostgreSQL) that kind of page had a p95 of 1,311 ms in a full bench/history.py run and 603 ms
once in a driver over the same fill, the slowest kind by far, while other stores filled the same way answered
it in 20-30 ms. With both columns in one index the page is one index walk of its 50 ids, however the values lie.
"""

from __future__ import annotations

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_jobs_queue_state_job_id", "jobs", ["queue", "state", "job_id"])


def downgrade() -> None:
    op.drop_index("ix_jobs_queue_state_job_id", table_name="jobs")
