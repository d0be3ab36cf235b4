"""The audit log's long-term home: `audit_entries` in the history database (schema.py).

Every service appends its entries to etcd before it answers (trainyard_core.audit.AuditLog: a write that must
not wait on a second database); the leader moves them here in batches (audit_archive.AuditMover) and deletes
them from etcd, so etcd holds only what is not moved yet. Reads merge the two (audit_archive.AuditReader).

Contracts:
- `add` is one transaction and idempotent by entry id (an entry is immutable: a second add of the same id,
  after a crash between this write and the etcd delete, keeps the first);
- `page` answers in the audit log's order, newest first (ascending id), after a keyset `after`, the same
  filter semantics as `AuditFilter.matches` (the SQL below says the same thing; a contract test runs both);
- `prune` deletes what is older than a cutoff, oldest first, a bounded batch per transaction.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

from trainyard_core.audit import AuditEntry, AuditFilter, action_name, ids_between

from .schema import audit_entries

Transaction = Callable[[str], AbstractAsyncContextManager[AsyncConnection]]

_COLUMNS = ("principal", "role", "service", "action", "target", "team", "result", "message", "request_id")


def _row(e: AuditEntry) -> dict[str, Any]:
    row: dict[str, Any] = {name: getattr(e, name) for name in _COLUMNS}
    row.update(id=e.id, time=e.time, user_name=e.user, action_name=action_name(e.action),
               detail=json.dumps(dict(e.detail), sort_keys=True, separators=(",", ":")))
    return row


def _entry(row: sa.Row[Any]) -> AuditEntry:
    detail = json.loads(row.detail) if row.detail else {}
    return AuditEntry(id=row.id, time=row.time, detail={str(k): str(v) for k, v in dict(detail).items()},
                      **{name: getattr(row, name) for name in _COLUMNS})


def _where(flt: AuditFilter, after: str) -> list[sa.ColumnElement[bool]]:
    c = audit_entries.c
    where: list[sa.ColumnElement[bool]] = [column == wanted for column, wanted in (
        (c.principal, flt.principal), (c.user_name, flt.user), (c.team, flt.team), (c.target, flt.target),
        (c.result, flt.result), (c.request_id, flt.request_id)) if wanted]
    if flt.action:
        if action_name(flt.action) == flt.action:  # a short form (no '/' or ' '): the indexed column says it
            where.append(sa.or_(c.action == flt.action, c.action_name == flt.action))
        else:  # a longer suffix such as `JobService/CancelJob`: rare, checked on the rows walked
            where.append(sa.or_(c.action == flt.action, c.action.endswith("/" + flt.action, autoescape=True),
                                c.action.endswith(" " + flt.action, autoescape=True)))
    newest, oldest = ids_between(flt.since, flt.until)
    low = max(after, newest or "") if after or newest else ""
    if low:
        where.append(c.id > low)
    if oldest is not None:
        where.append(c.id <= oldest)
    # The id bounds hold to the microsecond; the stored time decides within one.
    if flt.since is not None:
        where.append(c.time >= flt.since)
    if flt.until is not None:
        where.append(c.time <= flt.until)
    return where


class AuditTable:
    """`audit_entries` through the history store's transactions (HistoryStore.audit)."""

    def __init__(self, read: Transaction, write: Transaction, *, postgres: bool) -> None:
        self._read = read
        self._write = write
        self._postgres = postgres

    async def add(self, entries: Sequence[AuditEntry]) -> None:
        """Store `entries` (each with its id) in one transaction; ids already stored are left as they are."""
        rows = [_row(e) for e in entries]
        if not rows:
            return
        if any(not e.id for e in entries):
            raise ValueError("every audit entry needs its id (the sink that stored it gives it)")
        insert = (postgresql.insert(audit_entries) if self._postgres else sqlite.insert(audit_entries))
        async with self._write(f"add {len(rows)} audit entries") as conn:
            await conn.execute(insert.on_conflict_do_nothing(index_elements=["id"]), rows)

    async def page(self, flt: AuditFilter, *, limit: int, after: str = "") -> list[AuditEntry]:
        """At most `limit` entries matching `flt`, newest first, each older than the entry `after` ('' none)."""
        query = sa.select(audit_entries).where(*_where(flt, after)).order_by(audit_entries.c.id).limit(limit)
        async with self._read("read the audit log") as conn:
            return [_entry(row) for row in (await conn.execute(query)).all()]

    async def prune(self, *, before: float, batch: int = 1000, max_batches: int | None = None) -> int:
        """Delete the entries stamped before `before`, oldest first, `batch` per transaction, until a batch comes
        back short or after `max_batches`. Returns how many were deleted."""
        if batch < 1:
            raise ValueError(f"batch must be at least 1, not {batch}")
        _, through = ids_between(before, None)
        c = audit_entries.c
        deleted = done = 0
        while max_batches is None or done < max_batches:
            # Older entries have larger ids: from the largest down, through the primary key.
            oldest = sa.select(c.id).where(c.id > through, c.time < before).order_by(c.id.desc()).limit(batch)
            async with self._write(f"prune audit entries before {before}") as conn:
                n = int((await conn.execute(sa.delete(audit_entries).where(c.id.in_(oldest)))).rowcount)
            deleted += n
            done += 1
            if n < batch:
                break
        return deleted

    async def count(self) -> int:
        async with self._read("count audit entries") as conn:
            return int((await conn.execute(sa.select(sa.func.count()).select_from(audit_entries))).scalar_one())
