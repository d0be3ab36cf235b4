"""Reservations, the backfill guard: for a job that could be neither placed nor let in by preemption,
the earliest time it would fit if running gangs end at their time limits, and a hold on the GPUs it would
then use that are free now (Slurm's backfill: later jobs may use held GPUs only if they end before that
start).

Separate from the session because it keeps its own state across the session's jobs (the holds, and the
tries that bound this work per session) and decides nothing about placing now: the session only reads the
holds, to lend held GPUs to backfill and to keep them in step with what decisions take.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..domain.models import Allocation, Job
from .capacity import Found, Pool
from .releases import Release, ReleaseSearch
from .results import Reservation
from .topology import pick_gpus

if TYPE_CHECKING:
    from .place import _Session


def expected_end(alloc: Allocation, now: float) -> float:
    """When a running gang's GPUs will be free at the latest: now if it is being stopped, its time limit
    if it has one, never (inf) otherwise."""
    if alloc.stop_reason:
        return now
    return alloc.expected_end if alloc.expected_end is not None else math.inf


@dataclass
class Held:
    """A reservation's hold on GPUs that are free now (lent to backfill that ends before `start`)."""

    res: Reservation
    lendable: dict[str, list[int]]


class Reserver:
    """The session's reservations: at most `reservation_depth` held, after at most `reservation_depth +
    max_reservation_misses` tries."""

    def __init__(self, releases: ReleaseSearch) -> None:
        self.releases = releases
        self.held: list[Held] = []
        self.tries = 0

    def reserve(self, s: _Session, job: Job, admitted: Sequence[tuple[str, bool]]) -> None:
        if len(self.held) >= s.config.reservation_depth:
            return
        if self.tries >= s.config.reservation_depth + s.config.max_reservation_misses:
            return  # the jobs at the top cannot fit even when everything ends; the rest wait for a later cycle
        self.tries += 1
        ends: list[tuple[float, str, Allocation]] = []
        for alloc in s.snap.allocations.values():
            ends.append((expected_end(alloc, s.now), alloc.job_id, alloc))
        for d in s.result.decisions:
            limit = s.snap.jobs[d.job_id].spec.time_limit_s
            ends.append((s.now + limit if limit > 0 else math.inf, d.job_id,
                         Allocation(d.job_id, 0, d.assignments, "", 0, s.now)))
        ends.sort(key=lambda e: (e[0], e[1]))
        claimed = frozenset(n for h in self.held for n in h.res.nodes)
        best: tuple[float, int, str, Found] | None = None
        for rank, (model, _) in enumerate(admitted):
            pool = s.pools.get(model)
            if pool is None:
                continue
            table = self.releases.table(s, model)
            releases: list[Release] = []
            times: list[float] = []
            for end, job_id, alloc in ends:
                rels = table.get(job_id) if job_id in s.snap.allocations else s.index.releases_of(alloc, model)
                for rel in rels or ():
                    if rel[0] not in claimed:
                        releases.append(rel)
                        times.append(end)
            hit = self._min_prefix_excluding(s, job, pool, releases, claimed)
            if hit is None:
                continue
            k, found = hit
            start = times[k - 1] if k else s.now
            if best is None or (start, rank) < (best[0], best[1]):
                best = (start, rank, model, found)
        if best is None:
            return
        start, _, model, found = best
        pool = s.pools[model]
        lendable: dict[str, list[int]] = {}
        need = job.spec.resources.gpus_per_node
        for node_id in found.nodes:
            free_now = pool.free.get(node_id, [])
            if free_now:
                hold = list(pick_gpus(free_now, min(need, len(free_now)), s.gpu_islands(node_id)))
                pool.take(node_id, hold)
                s.touched.add(node_id)
                lendable[node_id] = hold
        res = Reservation(job.id, start, found.nodes, model)
        self.held.append(Held(res, lendable))
        s.result.reservations.append(res)

    def _min_prefix_excluding(self, s: _Session, job: Job, pool: Pool, releases: Sequence[Release],
                              claimed: frozenset[str]) -> tuple[int, Found] | None:
        if not claimed:
            return self.releases.min_prefix(s, job, pool, releases)
        # Nodes another reservation holds are not offered to this one.
        saved = {n: list(pool.free[n]) for n in claimed if n in pool.free}
        for n in saved:
            pool.set_free(n, [])
        try:
            return self.releases.min_prefix(s, job, pool, releases)
        finally:
            for n, free in saved.items():
                pool.set_free(n, free)
