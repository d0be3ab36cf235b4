"""The pure placement entry point: `place(snapshot, profile, config, now) -> PlacementResult`.

One call is one session over one snapshot (Volcano's `OpenSession`): it indexes free capacity per
accelerator model and topology domain, then takes pending jobs in queue order and, for each:

1. **Place** it whole on the fastest acceptable model that its quotas admit and that has room, packed
   into the lowest topology domain (see `capacity.py`). GPUs taken by earlier decisions of the session
   are not offered again: no GPU is ever in two gangs, and a gang is never partly placed.
2. Otherwise, if it may preempt, **choose victims**: the cheapest gangs (borrowed first, lowest standing,
   least work lost since their last checkpoint) whose GPUs, once freed, give it a block in the lowest
   domain — only gangs it outranks in its own team or that borrow quota, or any borrowed gang when it
   reclaims its own team's guarantee; never a job that preempted it before (no preemption loops).
3. Otherwise, for the first `reservation_depth` such jobs, **reserve**: find the earliest time it would
   fit if running gangs end at their time limits, and hold the GPUs it would use. Later jobs may use
   held GPUs only if their own time limit ends before that start (backfill never delays the
   reservation, as in Slurm); jobs without a time limit never backfill into a reservation.

Nothing here reads a clock or a store; `now` is passed in.

The session (`_Session`, here) walks the queue, looks for room now, and commits its decisions; the other
steps live apart and are called by it: model choice and quota admission (admission.py), the node-by-node
placement of CPU-only and mixed-model gangs (pernode.py), preemption (preempt.py), reservations
(reserve.py), and the search over releases those two share (releases.py). The result types are in
results.py and are imported from here.
"""

from __future__ import annotations

import heapq
import math
import zlib
from collections.abc import Callable, Sequence

from ..domain.models import TIERS, Allocation, Job, JobState, NodeAssignment
from ..domain.queues import PolicyConfig
from ..domain.snapshot import ClusterSnapshot
from . import pernode
from .admission import ModelAdmission
from .api import Ledger, NodeView, Profile
from .capacity import Found, Pool
from .index import ClusterIndex
from .preempt import Preemptor
from .releases import ReleaseSearch, always
from .reserve import Held, Reserver, expected_end
from .results import Decision, PlacementResult, Preemption, Reservation, Unplaced
from .topology import CLUSTER, TIER_INDEX, gang_tier, islands_of, pick_gpus

__all__ = ["Decision", "PlacementResult", "Preemption", "Reservation", "Unplaced", "choose_master_port",
           "expected_end", "place"]


def choose_master_port(job_id: str, attempt: int, used: set[int], port_range: tuple[int, int]) -> int:
    """A port on the rank-0 node that no live allocation there uses; spread by a hash of the job."""
    lo, hi = port_range
    span = hi - lo + 1
    start = zlib.crc32(f"{job_id}/{attempt}".encode()) % span
    for i in range(span):
        port = lo + (start + i) % span
        if port not in used:
            return port
    return lo + start  # every port taken: torch will report the clash on launch


def place(snapshot: ClusterSnapshot, profile: Profile, config: PolicyConfig, now: float,
          port_range: tuple[int, int] = (29500, 29999), timer: Callable[[], float] | None = None,
          index: ClusterIndex | None = None, *, reuse_verdicts: bool = True) -> PlacementResult:
    """Decide for every pending job. `index`, when given, is the one the caller kept from its previous call
    (same profile): it is brought up to date from `snapshot` instead of rebuilt — the result is the same.

    `reuse_verdicts`: a job that could not be placed, and whose consideration changed nothing in the session
    (nothing taken, reserved or preempted, no counter moved), leaves its reason for the later jobs of its
    `placement_shape`: while the session stays unchanged, they wait for the same reason without being
    looked at again (a burst of a thousand like submits on a full fleet costs one look, not a thousand, every
    cycle). The result is the same either way (tests/scheduler/test_placement_reuse.py)."""
    session = _Session(snapshot, profile, config, now, port_range, index, reuse_verdicts)
    try:
        return session.run(timer)
    finally:
        # GPUs this session took (for decisions and reservations) are re-derived from the next snapshot.
        session.index.dirty.update(session.touched)


class _Session:
    """One placement session over one snapshot: what is free, what it has decided, and the queue walk.

    Its parts (`admission`, `preemptor`, `reserver`, `releases`, and pernode.py's functions) are handed the
    session at each call and read its state through `find`, `node_ok`, `max_tier`, `gpu_islands`, `with_port`
    and its attributes; only the session takes GPUs and CPUs for a decision and charges the ledger
    (`_commit`)."""

    def __init__(self, snap: ClusterSnapshot, profile: Profile, config: PolicyConfig, now: float,
                 port_range: tuple[int, int], index: ClusterIndex | None, reuse_verdicts: bool = True) -> None:
        self.snap = snap
        # placement shape (and tier) → (the session's state when it was judged, why such a job waits)
        self._verdicts: dict[tuple[object, ...], tuple[tuple[int, ...], str]] | None = {} if reuse_verdicts else None
        self.profile = profile
        self.config = config
        self.now = now
        self.port_range = port_range
        self.result = PlacementResult()
        self.islands: dict[str, dict[int, int]] = {}
        self.ports = snap.used_master_ports()
        # The session's parts (see each module's docstring for what it decides and why it is apart).
        # They are handed the session at each call rather than keeping it: no reference cycle, so a session's
        # state is freed when `place` returns, not at the next cyclic garbage collection.
        self.admission = ModelAdmission()
        self.releases = ReleaseSearch()
        self.reserver = Reserver(self.releases)
        self.preemptor = Preemptor(self.releases)
        if index is None:
            index = ClusterIndex.of(snap, profile.gates)
        else:
            index.sync(snap)
        self._build(index)

    # -- session setup ---------------------------------------------------------------------------------
    def _build(self, index: ClusterIndex) -> None:
        snap = self.snap
        self.index = index
        self.paths = index.paths
        self.pools = index.pools
        self.views = index.views
        self.healthy = index.healthy
        self.model_of = index.model_of
        self.cpu_nodes = sorted(index.cpu_nodes)
        self.catalog = index.catalog
        self.free_cpus = _Overlay(index.base_free_cpus)
        self.touched: set[str] = set()
        self.ledger = Ledger(capacity=dict(index.capacity))
        for (team, queue, model, borrowed), gpus in sorted(index.held.items()):
            self.ledger.charge(team, queue, model, self._quota_key(team, model), gpus, borrowed)
        self.nominated: dict[str, list[Allocation]] = {}
        for alloc in snap.allocations.values():
            if alloc.preempted_by:
                self.nominated.setdefault(alloc.preempted_by, []).append(alloc)

    def _quota_key(self, team: str, model: str) -> str:
        quota = self.config.quotas.get(team)
        found = quota.limit_for(model) if quota is not None else None
        return found[0] if found is not None else model

    # -- the session -------------------------------------------------------------------------------------
    def run(self, timer: Callable[[], float] | None) -> PlacementResult:
        by_team: dict[str, list[Job]] = {}
        for job in self.snap.jobs.values():
            if job.state is JobState.PENDING and not job.cancel_requested and not job.held_by:
                by_team.setdefault(job.team, []).append(job)
        order = self.profile.order
        heap: list[tuple[tuple[float, ...], str, int]] = []
        ranked: dict[str, list[tuple[tuple[float, ...], str, Job]]] = {}
        for team, jobs in by_team.items():
            # Within a team the key differs only by standing and submission time, so sort once.
            ranked[team] = sorted(zip(order.keys(jobs, self.ledger, self.config), (j.id for j in jobs), jobs,
                                      strict=True), key=lambda e: (e[0], e[1]))
            heapq.heappush(heap, (*ranked[team][0][:2], 0))
        heads = {jobs[0][1]: team for team, jobs in ranked.items()}
        # A key reads the ledger, which only a decision changes: until the first, the sort's keys still hold.
        charged = len(self.result.decisions)
        while heap:
            _, job_id, i = heapq.heappop(heap)
            team = heads.pop(job_id)
            job = ranked[team][i][2]
            self.result.considered.append(job.id)
            started = timer() if timer else 0.0
            self._consider_or_reuse(job)
            if timer:
                self.result.timings.append((job.id, timer() - started))
            if i + 1 < len(ranked[team]):
                key, nxt_id, nxt = ranked[team][i + 1]
                heads[nxt_id] = team
                if len(self.result.decisions) != charged:
                    key = order.key(nxt, self.ledger, self.config)
                heapq.heappush(heap, (key, nxt_id, i + 1))
        return self.result

    def _state(self) -> tuple[int, ...]:
        """Changes with everything a consideration can change in the session (what it took, reserved,
        preempted, and the counters that bound reservations and preemptions)."""
        r = self.result
        return (len(r.decisions), len(r.reservations), len(r.preemptions), self.reserver.tries,
                self.preemptor.preemptors, len(self.preemptor.victims_taken))

    def _consider_or_reuse(self, job: Job) -> None:
        if self._verdicts is None or job.id in self.nominated:
            self._consider(job)
            return
        key = (*self.index.shape(job), self.max_tier(job))
        state = self._state()
        seen = self._verdicts.get(key)
        if seen is not None and seen[0] == state:
            self.result.unplaced.append(Unplaced(job.id, seen[1]))
            return
        before = len(self.result.unplaced)
        self._consider(job)
        out = self.result.unplaced
        if len(out) == before + 1 and out[-1].job_id == job.id and self._state() == state:
            self._verdicts[key] = (state, out[-1].reason)

    def _consider(self, job: Job) -> None:
        if job.spec.resources.cpu_only:
            decision, reason = pernode.place_cpu(self, job)
            if decision is not None:
                self._commit(job, decision)
            else:
                self.result.unplaced.append(Unplaced(job.id, reason))
            return
        models, reasons = self.admission.models(self, job)
        if not models:
            self.result.unplaced.append(Unplaced(job.id, "no accelerator in the fleet matches: " + reasons))
            return
        admitted: list[tuple[str, bool]] = []
        why: list[str] = []
        for model in models:
            verdict_ok, borrowed, reason = self.admission.admit(self, job, model)
            if not verdict_ok:
                why.append(reason)
                continue
            admitted.append((model, borrowed))
            hit = self._find_now(job, model)
            if hit is not None:
                self._commit(job, self._decision(job, model, borrowed, *hit))
                return
        if admitted and job.spec.resources.allow_mixed:
            decision = pernode.place_mixed(self, job, admitted)
            if decision is not None:
                self._commit(job, decision)
                return
        if not admitted:
            self.result.unplaced.append(Unplaced(job.id, "; ".join(dict.fromkeys(why))))
            return
        if self.preemptor.preempt(self, job, admitted):
            return
        self.reserver.reserve(self, job, admitted)
        r = job.spec.resources
        tier = self.max_tier(job)
        within = f" within one {TIERS[tier]}" if tier < CLUSTER else ""
        self.result.unplaced.append(Unplaced(job.id, (
            f"waiting for {r.nodes} node(s) with {r.gpus_per_node} free {'/'.join(m for m, _ in admitted)} "
            f"GPU(s){within}" + (f"; {'; '.join(dict.fromkeys(why))}" if why else ""))))

    # -- topology constraint ----------------------------------------------------------------------------
    def max_tier(self, job: Job) -> int:
        t = job.spec.topology
        if not t.tier:
            return CLUSTER
        waited = self.now - (job.queued_at or job.created_at)
        if t.required or waited < t.wait_s:
            return TIER_INDEX[t.tier]
        return CLUSTER

    # -- finding room ------------------------------------------------------------------------------------
    def node_ok(self, job: Job) -> Callable[[str], bool]:
        filters = [f for f in self.profile.node_filters if f.applies(job, self.config)]
        if not filters:
            return always
        views = self.views

        def ok(node_id: str) -> bool:
            view = views[node_id]
            if view.free_cpus != self.free_cpus[node_id]:
                view = NodeView(node=view.node, free_gpus=view.free_gpus, alive=view.alive,
                                has_orphans=view.has_orphans, free_cpus=self.free_cpus[node_id])
            return all(f.filter(job, view, self.config) is None for f in filters)
        return ok

    def _order(self, job: Job, pool: Pool) -> Callable[[str, int], float]:
        score = self.profile.node_score
        views = self.views

        def order(node_id: str, free: int) -> float:
            v = views[node_id]
            return score.score(job, NodeView(v.node, tuple(pool.free[node_id]), v.alive, v.has_orphans))
        return order

    def find(self, job: Job, pool: Pool) -> Found | None:
        r = job.spec.resources
        return pool.find(r.nodes, r.gpus_per_node, self.max_tier(job), self.node_ok(job), self._order(job, pool))

    def _find_now(self, job: Job, model: str) -> tuple[Found, list[Held]] | None:
        pool = self.pools.get(model)
        if pool is None:
            return None
        found = self.find(job, pool)
        if found is not None:
            return found, []
        # Backfill into held GPUs, only for a job sure to end before the reservation starts.
        end = self.now + job.spec.time_limit_s if job.spec.time_limit_s > 0 else math.inf
        lent = [h for h in self.reserver.held if h.res.model == model and end <= h.res.start]
        if not lent:
            return None
        for h in lent:
            for node_id, gpus in h.lendable.items():
                pool.give(node_id, gpus)
        found = self.find(job, pool)
        for h in lent:
            for node_id, gpus in h.lendable.items():
                pool.take(node_id, gpus)
        return (found, lent) if found is not None else None

    def _decision(self, job: Job, model: str, borrowed: bool, found: Found, lent: Sequence[Held]) -> Decision:
        r = job.spec.resources
        pool = self.pools[model]
        # Node ranks follow the topology: nodes of one leaf get consecutive ranks.
        ordered = sorted(found.nodes, key=lambda n: (self.paths[n][2], self.paths[n][1], self.paths[n][0], n))
        assignments = []
        single_island = True
        for node_rank, node_id in enumerate(ordered):
            islands = self.gpu_islands(node_id)
            free = set(pool.free.get(node_id, []))
            for h in lent:
                free.update(h.lendable.get(node_id, []))
            gpus = pick_gpus(free, r.gpus_per_node, islands)
            single_island = single_island and len({islands[g] for g in gpus}) == 1
            first = node_rank * r.gpus_per_node
            assignments.append(NodeAssignment(node_id=node_id, node_rank=node_rank, gpu_indices=gpus,
                                              ranks=tuple(range(first, first + r.gpus_per_node)), model=model,
                                              cpus=r.cpus_per_node))
        tier = gang_tier(ordered, self.paths, single_island)
        return self.with_port(job, Decision(job.id, tuple(assignments), 0, model, borrowed, tier))

    def gpu_islands(self, node_id: str) -> dict[int, int]:
        hit = self.islands.get(node_id)
        if hit is None:
            hit = self.islands[node_id] = islands_of(self.snap.nodes[node_id])
        return hit

    def with_port(self, job: Job, d: Decision) -> Decision:
        master = d.assignments[0].node_id
        port = choose_master_port(job.id, job.attempt, self.ports.get(master, set()), self.port_range)
        return Decision(d.job_id, d.assignments, port, d.model, d.borrowed, d.tier)

    def _commit(self, job: Job, d: Decision) -> None:
        """Take the decision's GPUs and CPUs out of the session and charge its team and queue."""
        for a in d.assignments:
            self.free_cpus[a.node_id] = self.free_cpus[a.node_id] - a.cpus
            if not a.gpu_indices:
                continue
            pool = self.pools[a.model]
            self.touched.add(a.node_id)
            taken = set(a.gpu_indices)
            for h in self.reserver.held:
                if a.node_id in h.lendable:
                    h.lendable[a.node_id] = [g for g in h.lendable[a.node_id] if g not in taken]
            pool.take(a.node_id, taken)
            self.ledger.charge(job.team, job.spec.queue, a.model, self._quota_key(job.team, a.model),
                               len(a.gpu_indices), d.borrowed)
        self.ports.setdefault(d.assignments[0].node_id, set()).add(d.master_port)
        self.result.decisions.append(d)


class _Overlay(dict[str, int]):
    """A session's changes over the index's free CPUs, leaving the index's own dict untouched."""

    def __init__(self, base: dict[str, int]) -> None:
        super().__init__()
        self._base = base

    def __missing__(self, key: str) -> int:
        return self._base.get(key, 0)
