"""Worker exits, recorded in their gang's allocation (or, once the gang is released, in the job's record)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

from trainyard_core.errors import Conflict
from trainyard_core.store.merged_updates import MergedUpdates

from ..domain.models import Allocation, WorkerExit

if TYPE_CHECKING:
    from .repository import Repository


class ExitRecords:
    def __init__(self, repo: Repository) -> None:
        self._repo = repo
        self._merged: MergedUpdates[tuple[str, int], WorkerExit, bool] = MergedUpdates(self._write)

    async def record(self, job_id: str, attempt: int, exit: WorkerExit) -> bool:
        """Idempotent per rank: a repeated report changes nothing. Lands in the gang's allocation; when
        the gang has already been released (its stop was confirmed before this report arrived), the exit
        is added to the finished job's record instead, so a job's exits end up complete.
        Returns False when neither the allocation nor the job of that attempt exists.

        Every worker of a gang reports its own exit, all at about the same time when the gang ends: the
        reports of one attempt that arrive while one of its writes is in flight go in the next, together
        (store/merged_updates.py), so a gang's n exits take a few writes, not n compare-and-swap rounds."""
        return await self._merged.submit((job_id, attempt), exit)

    async def _write(self, gang: tuple[str, int], exits: list[WorkerExit], tries: int = 10) -> bool:
        job_id, attempt = gang

        def added(recorded: Iterable[WorkerExit]) -> tuple[WorkerExit, ...]:
            ranks = {e.rank for e in recorded}
            new = []
            for e in exits:  # the first report of a rank counts; a repeat (a retry) changes nothing
                if e.rank not in ranks:
                    ranks.add(e.rank)
                    new.append(e)
            return tuple(new)

        def add(alloc: Allocation) -> Allocation | None:
            new = added(alloc.exits)
            return replace(alloc, exits=(*alloc.exits, *new)) if new else None

        if await self._repo.modify_allocation(job_id, attempt, add):
            return True
        for _ in range(tries):
            found = await self._repo.get_job(job_id)
            if found is None or found[0].attempt != attempt:
                return False
            job, rev = found
            if await self._repo.get_allocation(job_id) is not None:
                # Re-placed meanwhile (a new allocation of the same attempt): record it there.
                return await self._repo.modify_allocation(job_id, attempt, add)
            new = added(job.exits)
            if not new:
                return True
            complete = tuple(sorted((*job.exits, *new), key=lambda e: e.rank))
            try:
                await self._repo.update_job(replace(job, exits=complete), rev)
                return True
            except Conflict:
                continue
        raise Conflict(f"job {job_id} kept changing; exits of ranks {sorted(e.rank for e in exits)} not recorded yet")
