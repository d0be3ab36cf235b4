"""Garbage collection, the acting half: a reconcile pass of load snapshot → pure plan → guarded apply.

The rules are in `domain/gc.py` (what is removed when) and `domain/retention.py` (what retention keeps).
A pass:

1. takes the GC lock (`checkpoint-gc-lock`, bound to an etcd lease of `gc_lock_ttl_s`, kept alive while
   the pass runs), so one replica at a time does the work. A dry run takes no lock: it changes nothing;
2. loads every record, then the storage listing, then per job the retention policy, the latest pointer
   and the restore leases (the lease guard before the leases);
3. plans; a dry run returns the plan here;
4. applies each action as its own compare-and-swap guarded by the revisions of step 2 (record, lease
   guard); a lost race skips the action (the next pass decides again), so applying a stale plan can
   never delete what a concurrent tag, lease or commit protects. Files are removed only after the
   record says DELETED; an orphan with no record is re-checked just before its removal.

The lock is for efficiency, not safety: two overlapping passes (a lock that expired during a long pass)
are still correct, every step being guarded and idempotent.

Orphans are timed from when this process first saw them (kept in memory): after a restart or a fail-over
their grace starts again, which only delays a removal.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections import defaultdict

from trainyard_core.clock import Clock
from trainyard_core.errors import Conflict, TrainyardError
from trainyard_core.store import Put, absent
from trainyard_core.waits import completes_within

from . import metrics
from .domain.gc import ActionKind, GcAction, GcTiming, JobSnapshot, StoredLocation, VersionedCheckpoint, plan
from .manager import CheckpointManager
from .repository import LeaseState, StoredCheckpoint

log = logging.getLogger(__name__)


class GarbageCollector:
    def __init__(self, manager: CheckpointManager, clock: Clock, timing: GcTiming, *, lock_ttl_s: int = 30,
                 identity: str = "") -> None:
        self._manager = manager
        self._repo = manager.repo
        self._storage = manager.storage
        self._clock = clock
        self._timing = timing
        self._lock_ttl_s = lock_ttl_s
        self.identity = identity or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self._first_seen: dict[str, float] = {}
        self._local = asyncio.Lock()
        self.passes = 0

    # -- the pass -----------------------------------------------------------------------------------
    async def run_once(self, *, dry_run: bool = False) -> list[GcAction]:
        """One pass; returns the actions applied (dry run: the actions it would apply). Raises Conflict
        when another replica holds the GC lock."""
        async with self._local:
            if dry_run:
                jobs, stored, records = await self._snapshot()
                return plan(jobs, stored, self._first_seen, self._timing, self._clock.now())
            try:
                lease = await self._lock()
            except Conflict:
                metrics.GC_RUNS.labels("skipped").inc()
                raise
            except BaseException:
                metrics.GC_RUNS.labels("failed").inc()
                raise
            started = time.perf_counter()
            lost = asyncio.Event()
            keeper = asyncio.create_task(self._keep_lock(lease, lost), name="gc lock keepalive")
            ran = False
            try:
                jobs, stored, records = await self._snapshot()
                actions = plan(jobs, stored, self._first_seen, self._timing, self._clock.now())
                done = []
                for action in actions:
                    if lost.is_set():
                        log.warning("GC lock lost during a pass; the rest is left to the next pass")
                        break
                    if await self._apply(action, records):
                        done.append(action)
                self.passes += 1
                ran = True
                metrics.GC_SECONDS.observe(time.perf_counter() - started)
                if done:
                    log.info("GC pass", extra={"actions": len(done), "planned": len(actions)})
                return done
            finally:
                metrics.GC_RUNS.labels("ok" if ran else "failed").inc()
                keeper.cancel()
                try:
                    await self._repo.store.revoke_lease(lease)
                except TrainyardError as e:
                    log.warning("cannot release the GC lock (it expires by itself): %s", e)

    async def _snapshot(self) -> tuple[list[JobSnapshot], list[StoredLocation], dict[str, StoredCheckpoint]]:
        all_records = await self._repo.list_all()
        stored = await self._storage.list_locations()
        by_job: dict[str, list[StoredCheckpoint]] = defaultdict(list)
        for rec in all_records:
            by_job[rec.checkpoint.job_id].append(rec)
        jobs = []
        for job_id, recs in by_job.items():
            policy = await self._repo.retention(job_id)
            latest = await self._repo.latest_pointer(job_id)
            leases = await self._repo.lease_state(job_id)
            jobs.append(JobSnapshot(
                job_id=job_id, records=[VersionedCheckpoint(r.checkpoint, r.mod_revision) for r in recs],
                latest_id=latest.checkpoint_id, policy=policy, leased=leases.leased,
                lease_guard_revision=leases.guard_revision))
        recorded = {r.checkpoint.location for r in all_records}
        now = self._clock.now()
        present = set()
        for s in stored:
            if s.location not in recorded:
                present.add(s.location)
                self._first_seen.setdefault(s.location, now)
        for location in list(self._first_seen):
            if location not in present:
                del self._first_seen[location]
        return jobs, stored, {r.checkpoint.id: r for r in all_records}

    async def _apply(self, action: GcAction, records: dict[str, StoredCheckpoint]) -> bool:
        try:
            done = await self._apply_one(action, records)
        except TrainyardError as e:
            log.warning("GC action %s on %s failed: %s", action.kind.value, action.location, e.message)
            return False
        if done:
            metrics.GC_REMOVED.labels(metrics.action_label(action.kind)).inc()
            log.info("GC", extra={"action": action.kind.value, "job_id": action.job_id,
                                  "checkpoint_id": action.checkpoint_id, "reason": action.reason})
        return done

    async def _apply_one(self, action: GcAction, records: dict[str, StoredCheckpoint]) -> bool:
        rec = records.get(action.checkpoint_id)
        if action.kind is ActionKind.REMOVE_ORPHAN:
            if rec is None and await self._repo.load_in_job(action.job_id, action.checkpoint_id) is not None:
                return False  # a record appeared: not an orphan
            await self._storage.remove(action.location)
            self._first_seen.pop(action.location, None)
            return True
        if rec is None:
            return False
        if action.kind is ActionKind.ABORT_ABANDONED:
            return await self._manager.abort_if_unchanged(rec, f"abandoned: {action.reason}") is not None
        if action.kind is ActionKind.PURGE_TOMBSTONE:
            return await self._repo.purge(rec.checkpoint, expected_revision=rec.mod_revision)
        # DELETE_BY_RETENTION, REMOVE_ABORTED, REMOVE_DAMAGED: the record first, then the files.
        # The plan keeps leased checkpoints, so no lease is counted here; the guard revision makes the
        # transaction fail if one was taken since the snapshot.
        deleted = await self._manager.delete_if_unchanged(rec, LeaseState({}, action.lease_guard_revision))
        if deleted is None:
            return False
        await self._storage.remove(deleted.location)
        metrics.GC_REMOVED_BYTES.inc(rec.checkpoint.total_bytes)
        return True

    # -- the lock -----------------------------------------------------------------------------------
    async def _lock(self) -> int:
        store = self._repo.store
        key = self._repo.gc_lock_key
        lease = await store.grant_lease(self._lock_ttl_s)
        result = await store.txn([absent(key)], [Put(key, self.identity.encode(), lease)])
        if result.succeeded:
            return lease
        await store.revoke_lease(lease)
        holder = await store.get(key)
        raise Conflict(f"a GC pass is already running on {holder.value.decode() if holder else 'another replica'}; "
                       "retry when it is done")

    async def _keep_lock(self, lease: int, lost: asyncio.Event) -> None:
        while True:
            await asyncio.sleep(self._lock_ttl_s / 3)
            try:
                if await self._repo.store.keepalive(lease) <= 0:
                    lost.set()
                    return
            except TrainyardError:
                lost.set()
                return

    # -- the loop -----------------------------------------------------------------------------------
    async def run_forever(self, interval_s: float, stop: asyncio.Event) -> None:
        """A pass every `interval_s` until `stop` is set. A failed pass is logged and the loop goes on."""
        while not stop.is_set():
            if await completes_within(stop.wait(), interval_s):
                return
            try:
                await self.run_once()
            except Conflict as e:
                log.debug("GC pass skipped: %s", e.message)
            except TrainyardError as e:
                log.warning("GC pass failed: %s", e.message)
            except Exception:
                log.exception("GC pass failed")

