"""Search over releases: the fewest running gangs that, given back in a set order, let a blocked job fit,
and where.

Reservations (reserve.py: gangs in order of expected end) and preemption (preempt.py: victims, cheapest
first) ask the same question of the same per-model table of what each gang would give back, so the search
and the table live here, once per session, rather than in either of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..domain.models import Job
from .capacity import Found, Pool

if TYPE_CHECKING:
    from .place import _Session

# (node id, GPU indices) a running gang would give back on that node.
Release = tuple[str, tuple[int, ...]]


def always(node_id: str) -> bool:
    """The node filter of a job that no profile filter applies to (`_Session.node_ok`). `min_prefix`
    recognises it by identity: with no filter the pool's counts answer exactly, without full searches."""
    return True


class ReleaseSearch:
    """A session's release tables (one per model, built on first use) and the search over them."""

    def __init__(self) -> None:
        self._tables: dict[str, dict[str, list[Release]]] = {}

    def min_prefix(self, s: _Session, job: Job, pool: Pool,
                   releases: Sequence[Release]) -> tuple[int, Found] | None:
        """The fewest releases, in the given order, after which the job fits in `pool`, and where. When no
        node filter applies to the job the pool's counts answer exactly, in one sweep; otherwise doubling
        then bisection over full searches, O(log n) of them. Leaves the pool as it was."""
        n = len(releases)
        r = job.spec.resources

        def apply(a: int, b: int, give: bool) -> None:
            for node_id, gpus in releases[a:b]:
                (pool.give if give else pool.take)(node_id, gpus)

        if s.node_ok(job) is always:
            k = pool.first_fit([(node_id, len(g)) for node_id, g in releases], r.nodes, r.gpus_per_node,
                               s.max_tier(job))
            if k is None:
                return None
            apply(0, k, True)
            found = s.find(job, pool)
            apply(0, k, False)
            return (k, found) if found is not None else None

        def fits() -> bool:
            return s.find(job, pool) is not None

        applied = lo = 0
        step = 1
        ok = False
        while applied < n:
            nxt = min(n, applied + step)
            apply(applied, nxt, True)
            lo, applied = applied, nxt
            if fits():
                ok = True
                break
            step *= 2
        if not ok:
            apply(0, applied, False)
            return None
        hi = applied
        while hi - lo > 1:
            mid = (lo + hi) // 2
            apply(mid, hi, False)
            if fits():
                hi = mid
            else:
                apply(mid, hi, True)
                lo = mid
        found = s.find(job, pool)
        apply(0, hi, False)
        return (hi, found) if found is not None else None

    def table(self, s: _Session, model: str) -> dict[str, list[Release]]:
        """What each running gang would give back of `model` (healthy GPUs on schedulable nodes); the index
        keeps these between sessions."""
        table = self._tables.get(model)
        if table is None:
            table = {}
            for job_id, alloc in s.snap.allocations.items():
                rels = s.index.releases(job_id, alloc, model)
                if rels:
                    table[job_id] = rels
            self._tables[model] = table
        return table
