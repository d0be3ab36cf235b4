"""Restore leases: a job loading a checkpoint holds one, so neither Delete nor GC removes the checkpoint
under it.

A lease is an etcd lease of the requested TTL with one key bound to it,
`checkpoint-leases/<job_id>/<checkpoint_id>/<lease_id>`: etcd drops the key when the TTL runs out, so a
holder that dies releases its lease by itself, whichever replica (or none) is running. The lease id
handed out is the etcd lease id in hex.

Acquire writes the key in a transaction guarded by the record's mod revision as read COMMITTED, and
rewrites the job's lease guard key; a deletion requires the guard unchanged since it listed the leases.
So either the deletion sees the lease, or its transaction fails, or the acquisition fails (and sees the
checkpoint DELETED). Release and Renew check that the lease id belongs to the named checkpoint, so a
caller cannot revoke or keep alive other etcd leases (the scheduler's election lease, say).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from trainyard_core.clock import Clock
from trainyard_core.errors import Conflict, FailedPrecondition, NotFound

from . import metrics
from .domain import Checkpoint, CheckpointState
from .domain.validation import validate_checkpoint_id, validate_lease_id, validate_lease_request
from .repository import CheckpointRepository, RestoreLease

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Lease:
    lease_id: str
    ttl_s: int
    checkpoint: Checkpoint


class RestoreLeases:
    def __init__(self, repo: CheckpointRepository, clock: Clock, *, max_ttl_s: int, max_attempts: int = 16) -> None:
        self._repo = repo
        self._clock = clock
        self._max_ttl_s = max_ttl_s
        self._max_attempts = max_attempts

    async def acquire(self, checkpoint_id: str, ttl_s: int, holder: str) -> Lease:
        validate_checkpoint_id(checkpoint_id)
        validate_lease_request(ttl_s, self._max_ttl_s, holder)
        for _ in range(self._max_attempts):
            stored = await self._repo.load(checkpoint_id)
            if stored is None:
                raise NotFound(f"checkpoint {checkpoint_id} not found")
            ckpt = stored.checkpoint
            if ckpt.state is not CheckpointState.COMMITTED:
                raise FailedPrecondition(f"checkpoint {ckpt.id} cannot be leased for a restore: it is "
                                         f"{ckpt.state.value}; only committed checkpoints are restored")
            lease_id = await self._repo.store.grant_lease(ttl_s)
            if await self._repo.add_lease(ckpt, expected_revision=stored.mod_revision, lease_id=lease_id,
                                          holder=holder, ttl_s=ttl_s, now=self._clock.now()):
                log.info("restore lease acquired", extra={"job_id": ckpt.job_id, "checkpoint_id": ckpt.id,
                                                          "lease_id": f"{lease_id:x}", "ttl_s": ttl_s,
                                                          "holder": holder})
                metrics.LOADS.inc()
                metrics.LOAD_BYTES.inc(ckpt.total_bytes)
                return Lease(f"{lease_id:x}", ttl_s, ckpt)
            # The record changed (a tag, a deletion): give the unused lease back and decide again.
            await self._repo.store.revoke_lease(lease_id)
        raise Conflict(f"acquiring a restore lease on {checkpoint_id} lost {self._max_attempts} concurrent "
                       "updates in a row; retry")

    async def _find(self, checkpoint_id: str, lease_id: str) -> RestoreLease | None:
        validate_checkpoint_id(checkpoint_id)
        validate_lease_id(lease_id)
        stored = await self._repo.load(checkpoint_id)
        if stored is None:
            raise NotFound(f"checkpoint {checkpoint_id} not found")
        return await self._repo.lease(stored.checkpoint.job_id, checkpoint_id, int(lease_id, 16))

    async def renew(self, checkpoint_id: str, lease_id: str) -> int:
        """Restart the lease's TTL; returns it. NotFound when the lease expired or was released."""
        found = await self._find(checkpoint_id, lease_id)
        ttl = 0 if found is None else await self._repo.store.keepalive(found.lease_id)
        if ttl <= 0:
            raise NotFound(f"restore lease {lease_id} on checkpoint {checkpoint_id} has expired or was "
                           "released; acquire a new one")
        return ttl

    async def release(self, checkpoint_id: str, lease_id: str) -> None:
        """Idempotent: releasing an expired or released lease succeeds."""
        found = await self._find(checkpoint_id, lease_id)
        if found is not None:
            await self._repo.store.revoke_lease(found.lease_id)
            if found.acquired_at > 0:  # the load it covered is over
                metrics.LOAD_SECONDS.observe(max(0.0, self._clock.now() - found.acquired_at))
            log.info("restore lease released", extra={"checkpoint_id": checkpoint_id, "lease_id": lease_id})
