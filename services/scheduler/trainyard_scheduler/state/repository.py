"""Reads and writes of scheduler records. Every write is one transaction; leader writes carry the
election's fence, so a deposed leader's write fails instead of landing (see `trainyard_core.store.election`).

A write that loses its compare-and-swap raises `Conflict`; callers re-read and decide again. Every write is
a compare-and-swap on the revision the caller read (nodes included: `nodes.modify`, node_records.py), so no acknowledged
write is overwritten by one that was decided before it. Placing and releasing a gang also move the GPU
holdings of its nodes in the same transaction (`state/holdings.py`), so the store itself refuses a GPU to a
second gang. `written_revision` is the newest revision this repository's writes produced, so a reader of a
watch-fed copy can wait until that copy includes them (read-your-writes).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Sequence

from trainyard_core.audit import inline_audit
from trainyard_core.errors import Conflict, FailedPrecondition, IdempotencyKeyReused
from trainyard_core.store import Compare, Delete, Put, Store, TxnResult, absent, mod_revision_is
from trainyard_core.store.batch import TxnBatcher
from trainyard_core.store.merged_updates import MergedUpdates

from ..domain.models import Allocation, Job
from ..domain.queues import FairShareUsage
from . import holdings
from .codec import (
    decode_allocation,
    decode_job,
    encode_allocation,
    encode_job,
    encode_usage,
)
from .exit_records import ExitRecords
from .group_commit import HoldingsCommitter
from .holdings import HoldingsLedger, Source
from .keys import Keys
from .node_records import NodeRecords

log = logging.getLogger(__name__)

# A change of an allocation record: the record as it should become, or None for no change.
AllocationChange = Callable[[Allocation], Allocation | None]

# etcd's default --max-txn-ops: the most compares, or writes, one transaction may carry.
ETCD_DEFAULT_MAX_TXN_OPS = 128
# A submit's idempotency key answers a retry of that submit this long at least (Stripe's and most APIs' day).
DEFAULT_IDEMPOTENCY_TTL_S = 86400.0
IDEMPOTENCY_BUCKET_S = 3600.0


def _idempotency_record(value: bytes) -> tuple[str, str]:
    """(job id, request digest) of an idempotency key's value; keys written before digests were kept hold the
    job id alone (digest "": any request matches)."""
    text = value.decode(errors="replace")
    if not text.startswith("{"):
        return text, ""
    record = json.loads(text)
    return str(record["job"]), str(record.get("request", ""))


class IdempotentJobGone(Exception):
    """A submit's idempotency key names a job that is no longer in etcd (finished, archived, expired)."""

    def __init__(self, job_id: str) -> None:
        super().__init__(job_id)
        self.job_id = job_id


def placement_txn_ops(nodes: int) -> int:
    """Operations the largest side of a gang's placement transaction needs: the fence, the job's revision,
    the allocation's absence and one holdings compare per node (writes: job, allocation, one per node)."""
    return nodes + 3


def max_gang_nodes(max_txn_ops: int) -> int:
    """The largest gang (in nodes) whose placement fits one transaction of at most `max_txn_ops`."""
    return max_txn_ops - placement_txn_ops(0)


class Repository:
    def __init__(self, store: Store, keys: Keys, fence: Callable[[], Compare] | None = None, *,
                 holdings_source: Source | None = None, node_source: Source | None = None,
                 max_txn_ops: int = ETCD_DEFAULT_MAX_TXN_OPS,
                 idempotency_ttl_s: float = DEFAULT_IDEMPOTENCY_TTL_S) -> None:
        """`holdings_source` reads a holdings key for the GPU ledger (the leader passes its mirror; the
        default reads the store); `node_source`, where given (the mirror), is where `nodes.modify` reads first;
        `max_txn_ops` bounds the transactions that merge waiting writes."""
        self.store = store
        self.keys = keys
        self._fence = fence
        self.nodes = NodeRecords(store, keys, self._txn, fence, node_source)
        self.holdings = HoldingsLedger(keys, holdings_source or store.get)
        # New jobs are independent writes (each compares only its own absent keys): submitted concurrently, they
        # share etcd transactions (store/batch.py).
        self._creates = TxnBatcher(store)
        self._annotations = TxnBatcher(store)
        self._allocation_changes: MergedUpdates[tuple[str, int], AllocationChange, bool] = MergedUpdates(
            self._modify_allocation)
        self.exits = ExitRecords(self)
        self.holdings_writes = HoldingsCommitter(self.holdings, self._txn, lambda: self._fenced([]), max_txn_ops)
        self.written_revision = 0
        # The newest revision at which this repository created a job: at or after any job it created, and a
        # change of a job record (what a reader of the job watch waits for comes at once, not at a bookmark).
        self.created_revision = 0
        self.idempotency_ttl_s = idempotency_ttl_s
        self._idem_leases: dict[int, int] = {}
        self._idem_lock = asyncio.Lock()

    def _fenced(self, compares: Sequence[Compare]) -> list[Compare]:
        return [self._fence(), *compares] if self._fence is not None else list(compares)

    async def _txn(self, compares: Sequence[Compare], ops: Sequence[Put | Delete]) -> TxnResult:
        res = await self.store.txn(compares, ops)
        if res.succeeded:
            self.written_revision = max(self.written_revision, res.revision)
        return res

    # -- jobs ----------------------------------------------------------------------------------------
    async def _idempotency_lease(self, now: float, gone: int = 0) -> int:
        """The lease an idempotency key written at `now` is bound to: one per hour of writes, lasting
        `idempotency_ttl_s` past that hour's end, so a key lives at least that long and at most an hour more,
        at the cost of one lease grant an hour. `gone`: a lease etcd no longer has (one new lease replaces it,
        however many submits found it gone at once)."""
        bucket = int(now // IDEMPOTENCY_BUCKET_S)
        async with self._idem_lock:
            lease = self._idem_leases.get(bucket)
            if lease is None or lease == gone:
                lease = await self.store.grant_lease(int(self.idempotency_ttl_s + IDEMPOTENCY_BUCKET_S))
                self._idem_leases = {bucket: lease}
            return lease

    async def create_job(self, job: Job, idempotency_key: str = "", request_digest: str = "") -> tuple[Job, bool]:
        """Store a new job. Returns (job, created); with an idempotency key already used by this team for the
        same request (`request_digest`), returns the job created then and False; for another request,
        IdempotencyKeyReused. The key expires `idempotency_ttl_s` (and up to an hour) after the submit;
        IdempotentJobGone when it names a job that has left etcd since (the history has it)."""
        key = self.keys.job(job.id)
        idem = self.keys.idempotency(job.team, idempotency_key) if idempotency_key else ""
        lease = 0
        # The submit's audit entries (the scheduler's, and the gateway's it forwarded) ride on the create when
        # the audit log is on this store (audit.InlineAudit): one transaction for the job and its record. Not on
        # a retry after a refused lease (it may be the entries'): the interceptor then writes the scheduler's
        # entry on its own, as for any call, and the gateway its own.
        inline = inline_audit.get()
        for attempt in range(2):
            compares = [absent(key)]
            ops: list[Put | Delete] = [Put(key, encode_job(job))]
            if idem:
                lease = await self._idempotency_lease(job.created_at, gone=lease if attempt else 0)
                compares.append(absent(idem))
                record = json.dumps({"job": job.id, "request": request_digest}, separators=(",", ":"))
                ops.append(Put(idem, record.encode(), lease))
            carried = None
            if inline is not None and not attempt:
                carried = await inline.carry(self.store, f"job/{job.id}")
            if carried is not None:
                compares.extend(carried.compares)
                ops.extend(carried.puts)
            try:
                res = await self._creates.txn(compares, ops)
            except FailedPrecondition:  # a lease is gone (revoked, or etcd lost it): take a new one
                if carried is not None:
                    await carried.lease_gone()
                if (not idem and carried is None) or attempt:
                    raise
                continue
            break
        if res.succeeded:
            if carried is not None and inline is not None:
                inline.stored()
            self.written_revision = max(self.written_revision, res.revision)
            self.created_revision = max(self.created_revision, res.revision)
            return job, True
        if idem:
            kv = await self.store.get(idem)
            if kv is not None:
                job_id, digest = _idempotency_record(kv.value)
                if digest and request_digest and digest != request_digest:
                    raise IdempotencyKeyReused(
                        f"Idempotency-Key {idempotency_key!r} was used for another request (job {job_id}, with "
                        "another spec or user): a retry must send the same request; use a new key for a new one")
                found = await self.get_job(job_id)
                if found is not None:
                    return found[0], False
                raise IdempotentJobGone(job_id)
        raise Conflict(f"job {job.id} could not be stored; retry the submission")

    async def get_job(self, job_id: str) -> tuple[Job, int] | None:
        kv = await self.store.get(self.keys.job(job_id))
        return (decode_job(kv.value), kv.mod_revision) if kv else None

    async def list_jobs(self, *, before: str = "", limit: int,
                        match: Callable[[Job], bool] = lambda job: True) -> tuple[list[Job], bool]:
        """Up to `limit` jobs that `match`, newest first (job id descending), with ids below `before` when it
        is set; and whether more may follow. Reads etcd in pages, so a selective filter costs a walk over the
        live jobs (bounded: finished ones leave etcd after the job TTL), never one big read."""
        out: list[Job] = []
        cursor = self.keys.job(before) if before else None
        while True:
            page = await self.store.range(self.keys.jobs, start_after=cursor, limit=max(limit * 2, 50),
                                          descending=True)
            for kv in page.kvs:
                cursor = kv.key
                job = decode_job(kv.value)
                if not match(job):
                    continue
                out.append(job)
                if len(out) == limit:
                    return out, page.more or kv is not page.kvs[-1]
            if not page.more:
                return out, False

    async def update_job(self, job: Job, revision: int) -> int:
        res = await self._txn([mod_revision_is(self.keys.job(job.id), revision)],
                              [Put(self.keys.job(job.id), encode_job(job))])
        if not res.succeeded:
            raise Conflict(f"job {job.id} changed concurrently; retry")
        return res.revision

    async def delete_job(self, job: Job, revision: int) -> int:
        """Remove a finished job's record (the leader's archiver, once it is in the history store). Conflict
        when the record changed or leadership was lost."""
        key = self.keys.job(job.id)
        res = await self._txn(self._fenced([mod_revision_is(key, revision)]), [Delete(key)])
        if not res.succeeded:
            raise Conflict(f"job {job.id} changed concurrently; retry")
        return res.revision

    # -- allocations (leader only) ---------------------------------------------------------------------
    async def get_allocation(self, job_id: str) -> tuple[Allocation, int] | None:
        kv = await self.store.get(self.keys.allocation(job_id))
        return (decode_allocation(kv.value), kv.mod_revision) if kv else None

    async def commit_placement(self, job: Job, job_rev: int, alloc: Allocation) -> int:
        """The gang's one transaction: the job becomes ADMITTED, its allocation appears and its GPUs join
        the holdings of its nodes (each compared with the revision last seen), or nothing happens."""
        akey = self.keys.allocation(job.id)
        res = await self.holdings_writes.submit(
            [mod_revision_is(self.keys.job(job.id), job_rev), absent(akey)],
            [Put(self.keys.job(job.id), encode_job(job)), Put(akey, encode_allocation(alloc))],
            holdings.take(alloc))
        if not res.succeeded:
            raise Conflict(f"placement of {job.id} lost a race (job changed, a GPU of its nodes was taken or "
                           "given back meanwhile, or leadership lost)")
        return res.revision

    async def write(self, *, job: Job | None = None, job_rev: int = 0, alloc: Allocation | None = None,
                    alloc_rev: int = 0, release: Allocation | None = None) -> int:
        """Write a job and/or its allocation atomically; or, with `release`, delete that allocation (read at
        `alloc_rev`) and give its GPUs back in the same transaction."""
        compares: list[Compare] = []
        ops: list[Put | Delete] = []
        if job is not None:
            compares.append(mod_revision_is(self.keys.job(job.id), job_rev))
            ops.append(Put(self.keys.job(job.id), encode_job(job)))
        if alloc is not None:
            compares.append(mod_revision_is(self.keys.allocation(alloc.job_id), alloc_rev))
            ops.append(Put(self.keys.allocation(alloc.job_id), encode_allocation(alloc)))
        if release is None:
            res = await self._txn(self._fenced(compares), ops)
        else:
            compares.append(mod_revision_is(self.keys.allocation(release.job_id), alloc_rev))
            ops.append(Delete(self.keys.allocation(release.job_id)))
            res = await self.holdings_writes.submit(compares, ops, holdings.give_back(release))
        if not res.succeeded:
            raise Conflict("record changed concurrently or leadership lost")
        return res.revision

    async def annotate(self, job: Job, job_rev: int) -> int:
        """Write a job record that changed only in what it tells its user (a waiting job's reason), read at
        `job_rev`: like `write(job=...)`, but sent in one transaction with the other annotations of the moment
        (one cycle explains every job it could not place). Conflict as `write`."""
        key = self.keys.job(job.id)
        res = await self._annotations.txn(self._fenced([mod_revision_is(key, job_rev)]), [Put(key, encode_job(job))])
        if not res.succeeded:
            raise Conflict("record changed concurrently or leadership lost")
        self.written_revision = max(self.written_revision, res.revision)
        return res.revision

    async def drop_orphan_holdings(self, node_id: str, job_ids: Sequence[str]) -> bool:
        """Remove from a node's holdings the jobs that have no allocation (only a write that bypassed this
        repository leaves them). Guarded by each allocation's absence; returns whether anything changed."""
        if not set(job_ids) & set((await self.holdings.current(node_id)).jobs):
            return False
        res = await self.holdings_writes.submit([absent(self.keys.allocation(j)) for j in job_ids], [],
                                                holdings.drop([node_id], job_ids))
        if not res.succeeded:
            raise Conflict(f"holdings of {node_id} or an allocation changed concurrently")
        return True

    async def restore_holdings(self, alloc: Allocation, alloc_rev: int) -> bool:
        """Write the holdings an existing allocation implies where they are missing (allocations made
        before holdings existed). Guarded by the allocation's revision; returns whether anything changed.
        HeldElsewhere when another job holds one of its GPUs."""
        missing = [n for n, g in holdings.gpus_by_node(alloc).items()
                   if (await self.holdings.current(n)).jobs.get(alloc.job_id) != g]
        if not missing:
            return False
        res = await self.holdings_writes.submit(
            [mod_revision_is(self.keys.allocation(alloc.job_id), alloc_rev)], [], holdings.take(alloc))
        if not res.succeeded:
            raise Conflict(f"allocation of {alloc.job_id} or its nodes' holdings changed concurrently")
        return True

    async def modify_allocation(self, job_id: str, attempt: int, change: AllocationChange) -> bool:
        """Read-modify-write of an allocation with CAS retries. `change` returns None for 'no change'.
        Returns False when the allocation (of that attempt) no longer exists.

        A gang's nodes confirm its launch and its stop, and its ranks report their exits, all at about the same
        moment, each a change of this one record: changes of one attempt asked for while a write of it is in
        flight wait and are applied together, in order, in the next (store/merged_updates.py), instead of
        losing each other's compare-and-swap. `change` must not raise: it would fail the changes merged with it."""
        return await self._allocation_changes.submit((job_id, attempt), change)

    async def _modify_allocation(self, gang: tuple[str, int], changes: list[AllocationChange], tries: int = 10) -> bool:
        job_id, attempt = gang
        for _ in range(tries):
            found = await self.get_allocation(job_id)
            if found is None or found[0].attempt != attempt:
                return False
            alloc, rev = found
            new = alloc
            for change in changes:
                changed = change(new)
                if changed is not None:
                    new = changed
            if new is alloc:
                return True
            try:
                await self.write(alloc=new, alloc_rev=rev)
                return True
            except Conflict:
                continue
        raise Conflict(f"allocation of {job_id} kept changing; giving up after {tries} tries")

    # -- fair-share usage (leader only) -------------------------------------------------------------------
    async def put_usage(self, usage: FairShareUsage, revision: int) -> int:
        """Replace the usage record if it is still the one read at `revision` (0: absent)."""
        key = self.keys.usage
        guard = mod_revision_is(key, revision) if revision else absent(key)
        res = await self._txn(self._fenced([guard]), [Put(key, encode_usage(usage))])
        if not res.succeeded:
            raise Conflict("usage record changed concurrently or leadership lost")
        return res.revision
