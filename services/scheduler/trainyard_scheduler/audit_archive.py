"""The audit log leaves etcd for the history store (issue 14): etcd takes each entry, SQL keeps it.

Every service appends its audit entries to etcd before it answers (trainyard_core.audit.AuditLog), because
a write the answer waits for must go to the one store every service already reaches. Left there, the log is
most of etcd's size (two entries per job: 200,000 entries, 68 MB, for 100,000 jobs). So:

- `AuditMover` (the leader, beside the archiver): a pass reads the entries in etcd a chunk at a time, adds
  each chunk to the history store (one transaction, idempotent by entry id), then deletes that chunk's keys
  from etcd (a transaction per `txn_ops` keys). A crash or a lost leadership between the two means the next
  pass adds the same entries again, which changes nothing; so every entry is in the history exactly once, and
  none is deleted from etcd before it is stored there. Entries an old leader is still moving while a new one
  starts are the same case. Once an hour it prunes the history's entries older than the retention.
  A history store that cannot be reached leaves the entries in etcd, where their leases (the retention)
  still bound them; `trainyard_scheduler_audit_backlog_entries` says how many wait, and one warning per outage
  says why.
- `AuditReader` (every replica's AuditService): one query over both, merged by id, newest first, with the
  etcd query's page token (an entry id) valid for both.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from trainyard_core.audit import AuditEntry, AuditFilter, AuditLog, AuditPage, decode_page_token
from trainyard_core.clock import Clock
from trainyard_core.errors import Unavailable
from trainyard_core.store.api import Delete, Store
from trainyard_core.waits import completes_within

from . import metrics
from .history.access import History
from .history.store import HistoryUnavailable

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MoveSettings:
    retention_s: float           # entries older than this are pruned from the history (audit_retention_days)
    chunk: int = 500             # entries per history transaction
    txn_ops: int = 128           # keys deleted per etcd transaction (etcd's --max-txn-ops; 128 by default)
    max_chunks: int = 20         # chunks per pass at most, so that a large backlog does not hold the loop
    interval_s: float = 1.0      # between passes
    retry_s: float = 5.0         # after a pass failed
    prune_interval_s: float = 3600.0
    prune_batch: int = 1000
    prune_batches: int = 20


class AuditMover:
    """Moves one deployment's audit entries from etcd to the history store, for one leader's term."""

    def __init__(self, *, store: Store, log_: AuditLog, history: History, clock: Clock, settings: MoveSettings,
                 leading: Callable[[], bool] = lambda: True) -> None:
        self._store = store
        self._prefix = log_.prefix
        self._history = history
        self._clock = clock
        self._s = settings
        self._leading = leading
        self._failing = False
        self._next_prune = clock.monotonic()

    async def step(self) -> int:
        """One pass: up to `max_chunks` chunks moved; returns how many entries left etcd. HistoryUnavailable and
        Unavailable (etcd) propagate: the entries of the chunk in progress stay in etcd."""
        table = (await self._history.store()).audit
        moved = 0
        start: str | None = None
        for _ in range(self._s.max_chunks):
            if not self._leading():
                break
            page = await self._store.range(self._prefix, start_after=start, limit=self._s.chunk)
            if not page.kvs:
                break
            start = page.kvs[-1].key
            entries: list[AuditEntry] = []
            keys: list[str] = []
            for kv in page.kvs:
                try:
                    entry = AuditEntry.from_json(kv.value)
                except (ValueError, KeyError, TypeError):
                    # Left where it is (its lease still ends it), so that nothing unreadable is lost by moving.
                    log.warning("unreadable audit entry left in etcd", extra={"key": kv.key})
                    continue
                entries.append(entry)
                keys.append(kv.key)
            await table.add(entries)
            for first in range(0, len(keys), self._s.txn_ops):
                await self._store.txn([], [Delete(k) for k in keys[first:first + self._s.txn_ops]])
            moved += len(keys)
            metrics.AUDIT_MOVED.inc(len(keys))
            if not page.more:
                metrics.AUDIT_BACKLOG.set(0)
                return moved
        metrics.AUDIT_BACKLOG.set(await self._backlog())
        return moved

    async def _backlog(self) -> int:
        page = await self._store.range(self._prefix, limit=10_000)
        return len(page.kvs)

    async def prune(self) -> int | None:
        """A prune pass if one is due: how many entries it deleted, or None (not due, or failed: logged)."""
        s = self._s
        if self._clock.monotonic() < self._next_prune or not self._leading():
            return None
        self._next_prune = self._clock.monotonic() + s.prune_interval_s
        try:
            table = (await self._history.store()).audit
            pruned = await table.prune(before=self._clock.now() - s.retention_s, batch=s.prune_batch,
                                       max_batches=s.prune_batches)
        except (HistoryUnavailable, Unavailable) as exc:
            metrics.HISTORY_ERRORS.inc()
            log.warning("cannot prune the audit log: %s; trying again in %gs", exc, s.prune_interval_s)
            return None
        metrics.HISTORY_PRUNED.labels(kind="audit").inc(pruned)
        if pruned >= s.prune_batch * s.prune_batches:
            self._next_prune = self._clock.monotonic()  # more to delete: go on at the next pass
        if pruned:
            log.info("pruned the audit log", extra={"audit_pruned": pruned,
                                                    "audit_retention_days": s.retention_s / 86400})
        return pruned

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            wait = self._s.interval_s
            try:
                moved = await self.step()
                if self._failing:
                    self._failing = False
                    log.info("history store reachable again; moving the audit log resumed")
                if moved >= self._s.chunk * self._s.max_chunks:
                    wait = 0.0  # a backlog: the next pass at once (after other tasks had their turn)
                await self.prune()
            except (HistoryUnavailable, Unavailable) as exc:
                metrics.HISTORY_ERRORS.inc()
                if not self._failing:
                    self._failing = True
                    log.warning("cannot move audit entries to the history store: %s; they stay in etcd until it "
                                "answers", exc)
                wait = self._s.retry_s
            except Exception:  # a bug here must not end the term's other work
                log.exception("moving the audit log failed; trying again")
                wait = self._s.retry_s
            await completes_within(stop.wait(), wait)


class AuditReader:
    """The audit log as one: the entries still in etcd and those moved to the history store, newest first."""

    def __init__(self, log_: AuditLog, history: History | None) -> None:
        self._log = log_
        self._history = history

    async def query(self, flt: AuditFilter, *, page_size: int, page_token: str = "") -> AuditPage:
        live = await self._log.query(flt, page_size=page_size, page_token=page_token)
        if self._history is None:
            return live
        after = decode_page_token(page_token) if page_token else ""
        try:
            stored = await (await self._history.store()).audit.page(flt, limit=page_size + 1, after=after)
        except HistoryUnavailable as exc:
            raise Unavailable(f"the audit log is read from the history store, which cannot be reached now: {exc}; "
                              "retry") from None
        return merge(live, stored, page_size)


def merge(live: AuditPage, stored: Sequence[AuditEntry], page_size: int) -> AuditPage:
    """One page from the etcd part (`live`, a page of AuditLog.query) and the history's (`stored`: up to
    page_size + 1 entries after the same token), newest first (ascending id).

    Each source has looked at every entry up to a bound: etcd up to its page token (none: all of them), the
    history up to its page_size-th entry when it had more. Only entries up to the nearer bound are certain to
    be in order with everything the other source holds, so the page stops there, and its token is where it
    stopped: the next page continues after it in both sources. An entry in both (moved, not yet deleted from
    etcd) is kept once."""
    bounds = [live.next_page_token] if live.next_page_token else []
    if len(stored) > page_size:
        stored = stored[:page_size]
        bounds.append(stored[-1].id)
    bound = min(bounds) if bounds else None
    by_id = {e.id: e for e in stored}
    by_id.update((e.id, e) for e in live.entries)
    merged = [by_id[i] for i in sorted(by_id) if bound is None or i <= bound]
    if len(merged) > page_size:
        return AuditPage(merged[:page_size], merged[page_size - 1].id)
    return AuditPage(merged, bound or "")


__all__: Sequence[str] = ["AuditMover", "AuditReader", "MoveSettings", "merge"]
