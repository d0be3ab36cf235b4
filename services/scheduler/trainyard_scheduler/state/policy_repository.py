"""Reads and writes of the operator's policy records: queues (`{p}/queues/<name>`) and team quotas
(`{p}/quotas/<team>`). Every write is one transaction. Writes are not leader-fenced: any replica takes
them, like job submits; every replica's mirror, and so the leader's placement, sees the result.

The queue "default" always exists: it is listed with default settings until an operator stores it, and
it cannot be deleted. A queue that unfinished jobs name cannot be deleted either. That check reads the
jobs, then deletes the queue only if the queue record did not change meanwhile; a job submitted in that
instant may still name the queue, and then simply runs with the settings of an unknown queue (tier 0,
no partition, no cap).
"""

from __future__ import annotations

from trainyard_core.errors import Conflict, FailedPrecondition, NotFound
from trainyard_core.store import Delete, Put, Store, absent, mod_revision_is

from ..domain.queues import DEFAULT_QUEUE, QueueConfig, TeamQuota, validate_queue, validate_quota
from .codec import decode_job, decode_queue, decode_quota, encode_queue, encode_quota
from .keys import Keys

JOB_PAGE = 500
DELETE_TRIES = 10


class PolicyRepository:
    def __init__(self, store: Store, keys: Keys) -> None:
        self.store = store
        self.keys = keys

    # -- queues --------------------------------------------------------------------------------------
    async def list_queues(self) -> list[QueueConfig]:
        """Every stored queue, plus "default" when it is not stored, by name."""
        page = await self.store.range(self.keys.queues)
        queues = {q.name: q for q in (decode_queue(kv.value) for kv in page.kvs)}
        queues.setdefault(DEFAULT_QUEUE.name, DEFAULT_QUEUE)
        return [queues[name] for name in sorted(queues)]

    async def queue_names(self) -> frozenset[str]:
        return frozenset(q.name for q in await self.list_queues())

    async def get_queue(self, name: str) -> tuple[QueueConfig, int] | None:
        kv = await self.store.get(self.keys.queue(name))
        return (decode_queue(kv.value), kv.mod_revision) if kv else None

    async def put_queue(self, queue: QueueConfig) -> bool:
        """Create or replace; returns whether it was created."""
        validate_queue(queue)
        key = self.keys.queue(queue.name)
        value = encode_queue(queue)
        res = await self.store.txn([absent(key)], [Put(key, value)], [Put(key, value)])
        return res.succeeded

    async def delete_queue(self, name: str) -> QueueConfig:
        """Delete a queue no unfinished job names. NotFound when it does not exist; FailedPrecondition for
        "default" and for a queue in use."""
        if name == DEFAULT_QUEUE.name:
            raise FailedPrecondition('the queue "default" cannot be deleted: jobs that name no queue go there')
        for _ in range(DELETE_TRIES):
            found = await self.get_queue(name)
            if found is None:
                raise NotFound(f"queue {name} not found")
            queue, rev = found
            using = await self.count_unfinished_jobs(name)
            if using:
                raise FailedPrecondition(
                    f"queue {name} is used by {using} unfinished job(s) (pending, running or waiting to "
                    "restart); cancel them or wait until they end, then delete the queue")
            res = await self.store.txn([mod_revision_is(self.keys.queue(name), rev)],
                                       [Delete(self.keys.queue(name))])
            if res.succeeded:
                return queue
        raise Conflict(f"queue {name} kept changing; retry the delete")

    async def count_unfinished_jobs(self, queue: str) -> int:
        count = 0
        cursor: str | None = None
        while True:
            page = await self.store.range(self.keys.jobs, start_after=cursor, limit=JOB_PAGE)
            for kv in page.kvs:
                job = decode_job(kv.value)
                if job.spec.queue == queue and not job.state.terminal:
                    count += 1
            if not page.more or not page.kvs:
                return count
            cursor = page.kvs[-1].key

    # -- quotas --------------------------------------------------------------------------------------
    async def list_quotas(self, team: str = "") -> list[TeamQuota]:
        """Every team's quota by team, or only `team`'s (an empty list when it has none)."""
        if team:
            found = await self.get_quota(team)
            return [found] if found is not None else []
        page = await self.store.range(self.keys.quotas)
        return sorted((decode_quota(kv.value) for kv in page.kvs), key=lambda q: q.team)

    async def get_quota(self, team: str) -> TeamQuota | None:
        kv = await self.store.get(self.keys.quota(team))
        return decode_quota(kv.value) if kv else None

    async def put_quota(self, quota: TeamQuota) -> bool:
        """Create or replace; returns whether it was created."""
        validate_quota(quota)
        key = self.keys.quota(quota.team)
        value = encode_quota(quota)
        res = await self.store.txn([absent(key)], [Put(key, value)], [Put(key, value)])
        return res.succeeded

    async def delete_quota(self, team: str) -> TeamQuota:
        key = self.keys.quota(team)
        for _ in range(DELETE_TRIES):
            kv = await self.store.get(key)
            if kv is None:
                raise NotFound(f"team {team} has no quota")
            res = await self.store.txn([mod_revision_is(key, kv.mod_revision)], [Delete(key)])
            if res.succeeded:
                return decode_quota(kv.value)
        raise Conflict(f"the quota of team {team} kept changing; retry the delete")
