"""The history database's tables, as the store queries them (SQLAlchemy Core).

This is the schema at the head revision. The migrations under `migrations/versions/` create it step by step
and never import this module (a migration must keep producing what it produced when it was written); a test
compares the migrated database with these tables, so the two cannot drift apart unnoticed.

Four tables:

- `jobs`: one row per finished job. The columns the API filters on, and `record`, the scheduler's own
  encoding of the whole job, kept as opaque bytes so that the archive never loses a field this schema does not
  model.
- `job_labels`: a job's labels, one row per pair, so that a label filter is an index lookup.
- `usage_records`: one row per allocation (attempt) for accounting, with the job's team, user and
  project copied in, so that usage reports never join `jobs`. No foreign key to `jobs` (since revision 0002):
  job rows and usage records are pruned on their own schedules (`HistoryStore.prune`), and accounting usually
  outlives the jobs' details, as slurmdbd's PurgeUsageAfter does its PurgeJobAfter.

- `audit_entries`: the audit log of every service (trainyard_core.audit), moved here from etcd by the leader
  (`AuditMover`), one row per entry under the entry's own id. Ids sort newest first (their byte order is
  time order, reversed), so "newest first" is ascending id order and a time window is an id range.

Times are unix seconds as double precision, the job's own timestamps (no server clock): exact round trips of
the floats the scheduler uses, and the same on both backends.

Ordering and the "C" collation: job ids sort by submission time in code-point order, and the name prefix filter
is a range over code points. SQLite compares text byte-wise (BINARY) by default, which for UTF-8 is code-point
order; PostgreSQL compares with the database's collation, which in production is usually linguistic (en_US,
ICU) and orders `aBc` between `ab` and `ac`. So on PostgreSQL the columns that are ordered or range-scanned
(`job_id`, `name`) are declared COLLATE "C". Equality-only columns keep the database's collation (every
deterministic collation agrees on equality).

Indexes serve "one filter, newest first, LIMIT n" (ORDER BY job_id DESC): each is led by the filtered column
and ends in job_id, so the database walks the index backwards and stops after n rows, whatever the table's
size. `user` is spelled `user_name`: in PostgreSQL `user` is a reserved word, and an unquoted `SELECT user
FROM jobs` silently returns the session's role name for every row.
"""

from __future__ import annotations

import sqlalchemy as sa

# Names for constraints and indexes that migrations can refer to; the same on both backends.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)


def ordered_text() -> sa.types.TypeEngine[str]:
    """Text compared in code-point order on both backends (see the module docstring)."""
    return sa.Text().with_variant(sa.Text(collation="C"), "postgresql")


def unix_time() -> sa.types.TypeEngine[float]:
    return sa.Double()


jobs = sa.Table(
    "jobs", metadata,
    sa.Column("job_id", ordered_text(), primary_key=True),
    sa.Column("team", sa.Text(), nullable=False),
    sa.Column("user_name", sa.Text(), nullable=False),
    sa.Column("name", ordered_text(), nullable=False),
    sa.Column("queue", sa.Text(), nullable=False),
    sa.Column("state", sa.Text(), nullable=False),
    sa.Column("submitted_at", unix_time(), nullable=False),
    sa.Column("finished_at", unix_time(), nullable=False),
    sa.Column("archived_at", unix_time(), nullable=False),
    sa.Column("record", sa.LargeBinary(), nullable=False),
    sa.Index("ix_jobs_team_job_id", "team", "job_id"),
    # A team's dashboard filters by state ("our failed jobs") more than by anything else.
    sa.Index("ix_jobs_team_state_job_id", "team", "state", "job_id"),
    sa.Index("ix_jobs_user_name_job_id", "user_name", "job_id"),
    sa.Index("ix_jobs_state_job_id", "state", "job_id"),
    sa.Index("ix_jobs_queue_job_id", "queue", "job_id"),
    # An operator's "this queue's failed jobs": neither of the two above alone narrows it (migration 0005).
    sa.Index("ix_jobs_queue_state_job_id", "queue", "state", "job_id"),
    # A name prefix or a time range does not follow job_id order: the database reads the range and sorts it
    # (see store._page_query). With job_id in the index that is an index-only read of ids, and only the page's rows
    # are fetched. Every query of a team member is scoped to their team, so each range also has a team-led twin.
    sa.Index("ix_jobs_name_job_id", "name", "job_id"),
    sa.Index("ix_jobs_team_name_job_id", "team", "name", "job_id"),
    sa.Index("ix_jobs_submitted_at_job_id", "submitted_at", "job_id"),
    sa.Index("ix_jobs_team_submitted_at_job_id", "team", "submitted_at", "job_id"),
    sa.Index("ix_jobs_finished_at_job_id", "finished_at", "job_id"),  # also what pruning walks, oldest first
    sa.Index("ix_jobs_team_finished_at_job_id", "team", "finished_at", "job_id"),
)
# On PostgreSQL, jobs and job_labels are also vacuumed every 10,000 inserted rows (storage parameters that
# SQLAlchemy does not model, set by migration 0004): an index-only read skips the table only for rows the last
# VACUUM marked all-visible, and the default (every 20% of the table) would leave the newest rows, the ones
# newest-first pages read, costing a table read each.

job_labels = sa.Table(
    "job_labels", metadata,
    sa.Column("job_id", ordered_text(), sa.ForeignKey("jobs.job_id", ondelete="CASCADE"), primary_key=True),
    sa.Column("key", sa.Text(), primary_key=True),
    sa.Column("value", sa.Text(), nullable=False),
    sa.Index("ix_job_labels_key_value_job_id", "key", "value", "job_id"),
    # Small rows looked up by their key: on SQLite, stored in the primary key's b-tree (no rowid, no second
    # lookup); PostgreSQL ignores the option.
    sqlite_with_rowid=False,
)

usage_records = sa.Table(
    "usage_records", metadata,
    sa.Column("job_id", ordered_text(), primary_key=True),
    sa.Column("attempt", sa.Integer(), primary_key=True, autoincrement=False),
    sa.Column("team", sa.Text(), nullable=False),
    sa.Column("user_name", sa.Text(), nullable=False),
    sa.Column("project", sa.Text(), nullable=False),
    sa.Column("queue", sa.Text(), nullable=False),
    sa.Column("accelerator_model", sa.Text(), nullable=False),
    sa.Column("gpus", sa.Integer(), nullable=False),
    sa.Column("cpus", sa.Integer(), nullable=False),
    sa.Column("nodes", sa.Integer(), nullable=False),
    sa.Column("started_at", unix_time(), nullable=False),
    sa.Column("ended_at", unix_time(), nullable=False),
    sa.Index("ix_usage_records_team_started_at", "team", "started_at"),
    sa.Index("ix_usage_records_started_at", "started_at"),
    # Pruning deletes the records that ended before a cutoff, oldest first, a batch at a time.
    sa.Index("ix_usage_records_ended_at", "ended_at"),
    sqlite_with_rowid=False,
)

# A usage window [since, until) holds the records that started before `until` and ended after `since`: a
# two-sided interval test no single B-tree serves. With the longest record's duration D (this index makes
# max(duration) one lookup), such a record also started after since - D, so the started_at index reads just
# [since - D, until), in the order the report wants.
sa.Index("ix_usage_records_duration", usage_records.c.ended_at - usage_records.c.started_at)

# Every query is "these fields equal, newest first, LIMIT n" (ORDER BY id): each index is led by one filtered
# field and ends in id. `action_name` is the action's last part (after its last '/' or ' '), the form a filter
# names most (`CancelJob`); `user_name` is the user of a gateway user's principal ('' for certificates).
audit_entries = sa.Table(
    "audit_entries", metadata,
    sa.Column("id", ordered_text(), primary_key=True),
    sa.Column("time", unix_time(), nullable=False),
    sa.Column("principal", sa.Text(), nullable=False),
    sa.Column("user_name", sa.Text(), nullable=False),
    sa.Column("role", sa.Text(), nullable=False),
    sa.Column("service", sa.Text(), nullable=False),
    sa.Column("action", sa.Text(), nullable=False),
    sa.Column("action_name", sa.Text(), nullable=False),
    sa.Column("target", sa.Text(), nullable=False),
    sa.Column("team", sa.Text(), nullable=False),
    sa.Column("result", sa.Text(), nullable=False),
    sa.Column("message", sa.Text(), nullable=False),
    sa.Column("request_id", sa.Text(), nullable=False),
    sa.Column("detail", sa.Text(), nullable=False),  # a JSON object of strings
    sa.Index("ix_audit_entries_principal_id", "principal", "id"),
    sa.Index("ix_audit_entries_user_name_id", "user_name", "id"),
    sa.Index("ix_audit_entries_team_id", "team", "id"),
    sa.Index("ix_audit_entries_action_name_id", "action_name", "id"),
    sa.Index("ix_audit_entries_target_id", "target", "id"),
    sa.Index("ix_audit_entries_result_id", "result", "id"),
    sa.Index("ix_audit_entries_request_id_id", "request_id", "id"),
)
