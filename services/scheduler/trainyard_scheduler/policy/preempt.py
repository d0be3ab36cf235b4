"""Preemption: for a job that fits nowhere now, the cheapest running gangs (borrowed first, lowest
standing, least work lost since their last checkpoint) whose GPUs, once freed, give it a block in the
lowest domain — only gangs it outranks in its own team or that borrow quota, or any borrowed gang when it
reclaims its own team's guarantee; never a job that preempted it before (no preemption loops).

Separate from the session because it keeps its own state across the session's jobs (the victims already
taken, so no gang is given to two preemptors, the preemptors counted against `max_preemptors`, and the
victim pool computed once) and only records preemptions: the victims' GPUs come back to the preemptor in a
later cycle, once they have stopped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..domain.models import Allocation, Job
from ..domain.queues import standing
from .capacity import Found, Pool
from .releases import Release, ReleaseSearch
from .results import Preemption

if TYPE_CHECKING:
    from .place import _Session


class Preemptor:
    """The session's preemptions: at most `max_preemptors` preemptors, no gang a victim twice."""

    def __init__(self, releases: ReleaseSearch) -> None:
        self.releases = releases
        self.victims_taken: set[str] = set()
        self.preemptors = 0
        self._victims: list[tuple[tuple[float, ...], str, Allocation, tuple[int, int, int]]] | None = None

    def preempt(self, s: _Session, job: Job, admitted: Sequence[tuple[str, bool]]) -> bool:
        """Choose victims for a blocked job; True when a preemption was decided (or is under way)."""
        if job.id in s.nominated:
            return False  # its victims are still stopping; their GPUs come back to it then
        cls = s.config.priority_class(job.spec.priority_class)
        if not s.config.preemption or not cls.can_preempt:
            return False
        if self.preemptors >= s.config.max_preemptors:
            return False  # bounded work per session; the rest try again next cycle
        mine = standing(job.spec.queue, job.spec.priority_class, job.spec.priority, s.config)
        pool_all = self._victim_pool(s)
        if not pool_all or (mine <= pool_all[0][3] and all(b for _, b in admitted)):
            return False  # outranks nobody and reclaims nothing
        self.preemptors += 1
        for model, borrowed in admitted:
            candidates: list[tuple[tuple[float, ...], str, Allocation]] = []
            for c, job_id, alloc, _ in pool_all:
                if job_id in self.victims_taken or job_id in job.preempted_by:
                    continue
                outranks = mine > alloc.priority and (alloc.team == job.team or alloc.borrowed)
                reclaims = not borrowed and alloc.borrowed and alloc.team != job.team
                if outranks or reclaims:
                    candidates.append((c, job_id, alloc))
            if not candidates:
                continue
            pool = s.pools.get(model)
            if pool is None:
                continue
            table = self.releases.table(s, model)
            releases: list[Release] = []
            owner: list[str] = []
            for _, job_id, _alloc in candidates:
                for rel in table.get(job_id, ()):
                    releases.append(rel)
                    owner.append(job_id)
            hit = self.releases.min_prefix(s, job, pool, releases)
            if hit is None:
                continue
            k, found = hit
            victims = self._prune(job, pool, found, releases[:k], owner[:k])
            if not victims:
                continue
            self.victims_taken.update(victims)
            why = "reclaiming its team's quota" if not borrowed and not any(
                mine > s.snap.allocations[v].priority for v in victims) else "higher standing"
            s.result.preemptions.append(Preemption(job.id, tuple(victims), f"preempted by {job.id} ({why})"))
            return True
        return False

    def _victim_pool(self, s: _Session) -> list[tuple[tuple[float, ...], str, Allocation, tuple[int, int, int]]]:
        """Running gangs that could ever be preempted, cheapest first (computed once per session); the 4th
        element of every entry is the lowest standing among them."""
        if self._victims is None:
            cost = s.profile.victim_cost
            out = []
            for alloc in s.snap.allocations.values():
                victim = s.snap.jobs.get(alloc.job_id)
                if (victim is not None and not alloc.stop_reason and alloc.preemptible
                        and s.now >= s.config.exempt_until(alloc.created_at, len(victim.preempted_by))):
                    out.append((cost.cost(victim, alloc, s.now), alloc.job_id, alloc, alloc.priority))
            out.sort(key=lambda c: (c[0], c[1]))
            lowest = min((c[3] for c in out), default=(0, 0, 0))
            self._victims = [(c[0], c[1], c[2], lowest) for c in out]
        return self._victims

    def _prune(self, job: Job, pool: Pool, found: Found, releases: Sequence[Release],
               owner: Sequence[str]) -> list[str]:
        """The victims needed for the found block: only gangs on its nodes, and of those drop the most
        expensive ones while every node still gets its share."""
        need = job.spec.resources.gpus_per_node
        nodes = set(found.nodes)
        by_victim: dict[str, list[Release]] = {}
        order: list[str] = []
        for rel, v in zip(releases, owner, strict=True):
            if rel[0] in nodes:
                if v not in by_victim:
                    order.append(v)
                by_victim.setdefault(v, []).append(rel)

        def enough(chosen: Sequence[str]) -> bool:
            free = {n: len(pool.free.get(n, [])) for n in nodes}
            for v in chosen:
                for node_id, gpus in by_victim[v]:
                    free[node_id] += len(gpus)
            return all(f >= need for f in free.values())

        chosen = list(order)
        if not enough(chosen):
            return []
        for v in reversed(order):  # most expensive first
            trial = [x for x in chosen if x != v]
            if enough(trial):
                chosen = trial
        return chosen
