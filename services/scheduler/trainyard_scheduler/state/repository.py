"""Reads and writes of scheduler records. Every write is one transaction; leader writes carry the
election's fence, so a deposed leader's write fails instead of landing (see `trainyard_core.store.election`).

A write that loses its compare-and-swap raises `Conflict`; callers re-read and decide again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace

from trainyard_core.errors import Conflict, NotFound
from trainyard_core.store import Compare, Delete, Put, Store, absent, mod_revision_is

from ..domain.models import Allocation, Job, JobState, Node, WorkerExit
from ..domain.queues import FairShareUsage
from .codec import (
    decode_allocation,
    decode_job,
    decode_node,
    encode_allocation,
    encode_job,
    encode_node,
    encode_usage,
)
from .keys import Keys

log = logging.getLogger(__name__)


class Repository:
    def __init__(self, store: Store, keys: Keys, fence: Callable[[], Compare] | None = None) -> None:
        self.store = store
        self.keys = keys
        self._fence = fence

    def _fenced(self, compares: Sequence[Compare]) -> list[Compare]:
        return [self._fence(), *compares] if self._fence is not None else list(compares)

    # -- jobs ----------------------------------------------------------------------------------------
    async def create_job(self, job: Job, idempotency_key: str = "") -> tuple[Job, bool]:
        """Store a new job. Returns (job, created); with an idempotency key already used by this team,
        returns the job created then and False."""
        key = self.keys.job(job.id)
        compares = [absent(key)]
        ops: list[Put | Delete] = [Put(key, encode_job(job))]
        idem = self.keys.idempotency(job.team, idempotency_key) if idempotency_key else ""
        if idem:
            compares.append(absent(idem))
            ops.append(Put(idem, job.id.encode()))
        res = await self.store.txn(compares, ops)
        if res.succeeded:
            return job, True
        if idem:
            kv = await self.store.get(idem)
            if kv is not None:
                found = await self.get_job(kv.value.decode())
                if found is not None:
                    return found[0], False
        raise Conflict(f"job {job.id} could not be stored; retry the submission")

    async def get_job(self, job_id: str) -> tuple[Job, int] | None:
        kv = await self.store.get(self.keys.job(job_id))
        return (decode_job(kv.value), kv.mod_revision) if kv else None

    async def list_jobs(self, *, after: str | None, limit: int, team: str = "",
                        states: frozenset[JobState] = frozenset()) -> tuple[list[Job], str]:
        """One page of jobs in submission order, filtered; returns (jobs, next page token)."""
        out: list[Job] = []
        cursor = self.keys.job(after) if after else None
        while len(out) < limit:
            page = await self.store.range(self.keys.jobs, start_after=cursor, limit=max(limit * 2, 50))
            for kv in page.kvs:
                cursor = kv.key
                job = decode_job(kv.value)
                if (team and job.team != team) or (states and job.state not in states):
                    continue
                out.append(job)
                if len(out) == limit:
                    more = page.more or kv is not page.kvs[-1]
                    return out, (job.id if more else "")
            if not page.more:
                break
        return out, ""

    async def update_job(self, job: Job, revision: int) -> int:
        res = await self.store.txn([mod_revision_is(self.keys.job(job.id), revision)],
                                   [Put(self.keys.job(job.id), encode_job(job))])
        if not res.succeeded:
            raise Conflict(f"job {job.id} changed concurrently; retry")
        return res.revision

    # -- allocations (leader only) ---------------------------------------------------------------------
    async def get_allocation(self, job_id: str) -> tuple[Allocation, int] | None:
        kv = await self.store.get(self.keys.allocation(job_id))
        return (decode_allocation(kv.value), kv.mod_revision) if kv else None

    async def commit_placement(self, job: Job, job_rev: int, alloc: Allocation) -> int:
        """The gang's one transaction: the job becomes ADMITTED and its allocation appears, or nothing."""
        akey = self.keys.allocation(job.id)
        res = await self.store.txn(
            self._fenced([mod_revision_is(self.keys.job(job.id), job_rev), absent(akey)]),
            [Put(self.keys.job(job.id), encode_job(job)), Put(akey, encode_allocation(alloc))])
        if not res.succeeded:
            raise Conflict(f"placement of {job.id} lost a race (job changed or leadership lost)")
        return res.revision

    async def write(self, *, job: Job | None = None, job_rev: int = 0, alloc: Allocation | None = None,
                    alloc_rev: int = 0, release: str = "") -> int:
        """Write a job and/or its allocation (or delete the allocation named by `release`) atomically."""
        compares: list[Compare] = []
        ops: list[Put | Delete] = []
        if job is not None:
            compares.append(mod_revision_is(self.keys.job(job.id), job_rev))
            ops.append(Put(self.keys.job(job.id), encode_job(job)))
        if alloc is not None:
            compares.append(mod_revision_is(self.keys.allocation(alloc.job_id), alloc_rev))
            ops.append(Put(self.keys.allocation(alloc.job_id), encode_allocation(alloc)))
        if release:
            compares.append(mod_revision_is(self.keys.allocation(release), alloc_rev))
            ops.append(Delete(self.keys.allocation(release)))
        res = await self.store.txn(self._fenced(compares), ops)
        if not res.succeeded:
            raise Conflict("record changed concurrently or leadership lost")
        return res.revision

    async def modify_allocation(self, job_id: str, attempt: int,
                                change: Callable[[Allocation], Allocation | None], tries: int = 10) -> bool:
        """Read-modify-write of an allocation with CAS retries. `change` returns None for 'no change'.
        Returns False when the allocation (of that attempt) no longer exists."""
        for _ in range(tries):
            found = await self.get_allocation(job_id)
            if found is None or found[0].attempt != attempt:
                return False
            alloc, rev = found
            new = change(alloc)
            if new is None:
                return True
            try:
                await self.write(alloc=new, alloc_rev=rev)
                return True
            except Conflict:
                continue
        raise Conflict(f"allocation of {job_id} kept changing; giving up after {tries} tries")

    async def record_exit(self, job_id: str, attempt: int, exit: WorkerExit, tries: int = 10) -> bool:
        """Idempotent per rank: a repeated report changes nothing. Lands in the gang's allocation; when
        the gang has already been released (its stop was confirmed before this report arrived), the exit
        is added to the finished job's record instead, so a job's exits end up complete.
        Returns False when neither the allocation nor the job of that attempt exists."""

        def add(alloc: Allocation) -> Allocation | None:
            if any(e.rank == exit.rank for e in alloc.exits):
                return None
            return replace(alloc, exits=(*alloc.exits, exit))

        if await self.modify_allocation(job_id, attempt, add):
            return True
        for _ in range(tries):
            found = await self.get_job(job_id)
            if found is None or found[0].attempt != attempt:
                return False
            job, rev = found
            if await self.get_allocation(job_id) is not None:
                # Re-placed meanwhile (a new allocation of the same attempt): record it there.
                return await self.modify_allocation(job_id, attempt, add)
            if any(e.rank == exit.rank for e in job.exits):
                return True
            exits = tuple(sorted((*job.exits, exit), key=lambda e: e.rank))
            try:
                await self.update_job(replace(job, exits=exits), rev)
                return True
            except Conflict:
                continue
        raise Conflict(f"job {job_id} kept changing; exit of rank {exit.rank} not recorded yet")

    # -- fair-share usage (leader only) -------------------------------------------------------------------
    async def put_usage(self, usage: FairShareUsage, revision: int) -> int:
        """Replace the usage record if it is still the one read at `revision` (0: absent)."""
        key = self.keys.usage
        guard = mod_revision_is(key, revision) if revision else absent(key)
        res = await self.store.txn(self._fenced([guard]), [Put(key, encode_usage(usage))])
        if not res.succeeded:
            raise Conflict("usage record changed concurrently or leadership lost")
        return res.revision

    # -- nodes ---------------------------------------------------------------------------------------
    async def list_nodes(self) -> list[Node]:
        page = await self.store.range(self.keys.nodes)
        return [decode_node(kv.value) for kv in page.kvs]

    async def get_node(self, node_id: str) -> Node:
        kv = await self.store.get(self.keys.node(node_id))
        if kv is None:
            raise NotFound(f"node {node_id} is not registered")
        return decode_node(kv.value)

    async def put_node(self, node: Node) -> None:
        res = await self.store.txn(self._fenced([]), [Put(self.keys.node(node.node_id), encode_node(node))])
        if not res.succeeded:
            raise Conflict("leadership lost while writing a node")
