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
"""

from __future__ import annotations

import heapq
import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..domain.models import TIERS, Allocation, Job, JobState, NodeAssignment
from ..domain.queues import PolicyConfig, standing
from ..domain.snapshot import ClusterSnapshot
from .api import Ledger, NodeView, Profile
from .capacity import Found, Pool, select_by_leaves
from .index import ClusterIndex
from .topology import CLUSTER, NODE, TIER_INDEX, gang_tier, islands_of, pick_gpus


@dataclass(frozen=True, slots=True)
class Decision:
    job_id: str
    assignments: tuple[NodeAssignment, ...]
    master_port: int
    model: str = ""
    borrowed: bool = False
    tier: int = NODE


@dataclass(frozen=True, slots=True)
class Preemption:
    preemptor: str
    victims: tuple[str, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class Reservation:
    job_id: str
    start: float  # math.inf when some gang it waits for has no time limit
    nodes: tuple[str, ...]
    model: str


@dataclass(frozen=True, slots=True)
class Unplaced:
    job_id: str
    reason: str


@dataclass
class PlacementResult:
    decisions: list[Decision] = field(default_factory=list)
    preemptions: list[Preemption] = field(default_factory=list)
    reservations: list[Reservation] = field(default_factory=list)
    unplaced: list[Unplaced] = field(default_factory=list)
    # Every job the session considered, in the order it did (the queue order: domain/pending.py).
    considered: list[str] = field(default_factory=list)
    # (job id, seconds) per job considered, when a timer was passed (benchmarks).
    timings: list[tuple[str, float]] = field(default_factory=list)


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


def expected_end(alloc: Allocation, now: float) -> float:
    """When a running gang's GPUs will be free at the latest: now if it is being stopped, its time limit
    if it has one, never (inf) otherwise."""
    if alloc.stop_reason:
        return now
    return alloc.expected_end if alloc.expected_end is not None else math.inf


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


@dataclass
class _Held:
    """A reservation's hold on GPUs that are free now (lent to backfill that ends before `start`)."""

    res: Reservation
    lendable: dict[str, list[int]]


Release = tuple[str, tuple[int, ...]]


class _Session:
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
        self.held: list[_Held] = []
        self.victims_taken: set[str] = set()
        self.preemptors = 0
        self.reservation_tries = 0
        self._rel_cache: dict[str, dict[str, list[Release]]] = {}
        self._victims: list[tuple[tuple[float, ...], str, Allocation, tuple[int, int, int]]] | None = None
        self._models_cache: dict[tuple[object, ...], tuple[list[str], str]] = {}
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
        return (len(r.decisions), len(r.reservations), len(r.preemptions), self.reservation_tries, self.preemptors,
                len(self.victims_taken))

    def _consider_or_reuse(self, job: Job) -> None:
        if self._verdicts is None or job.id in self.nominated:
            self._consider(job)
            return
        key = (*self.index.shape(job), self._max_tier(job))
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
            decision, reason = self._place_cpu(job)
            if decision is not None:
                self._commit(job, decision)
            else:
                self.result.unplaced.append(Unplaced(job.id, reason))
            return
        models, reasons = self._models(job)
        if not models:
            self.result.unplaced.append(Unplaced(job.id, "no accelerator in the fleet matches: " + reasons))
            return
        admitted: list[tuple[str, bool]] = []
        why: list[str] = []
        for model in models:
            verdict_ok, borrowed, reason = self._admit(job, model)
            if not verdict_ok:
                why.append(reason)
                continue
            admitted.append((model, borrowed))
            hit = self._find_now(job, model)
            if hit is not None:
                self._commit(job, self._decision(job, model, borrowed, *hit))
                return
        if admitted and job.spec.resources.allow_mixed:
            decision = self._place_mixed(job, admitted)
            if decision is not None:
                self._commit(job, decision)
                return
        if not admitted:
            self.result.unplaced.append(Unplaced(job.id, "; ".join(dict.fromkeys(why))))
            return
        if self._preempt(job, admitted):
            return
        self._reserve(job, admitted)
        r = job.spec.resources
        tier = self._max_tier(job)
        within = f" within one {TIERS[tier]}" if tier < CLUSTER else ""
        self.result.unplaced.append(Unplaced(job.id, (
            f"waiting for {r.nodes} node(s) with {r.gpus_per_node} free {'/'.join(m for m, _ in admitted)} "
            f"GPU(s){within}" + (f"; {'; '.join(dict.fromkeys(why))}" if why else ""))))

    # -- models, admission -------------------------------------------------------------------------------
    def _models(self, job: Job) -> tuple[list[str], str]:
        r = job.spec.resources
        shape = (r.accelerator, r.accelerators, r.vendor, r.min_memory_gb, r.min_compute_capability,
                 tuple(sorted(r.speed_hints.items())))
        hit = self._models_cache.get(shape)
        if hit is not None:
            return hit
        ok: list[tuple[float, str]] = []
        reasons: list[str] = []
        for model, info in self.catalog.items():
            rejected = next((x for f in self.profile.model_filters if (x := f.filter(job, info)) is not None), None)
            if rejected is None:
                ok.append((-self.profile.model_score.score(job, info, self.config), model))
            else:
                reasons.append(f"{model}: {rejected}")
        found = [m for _, m in sorted(ok)], "; ".join(reasons) or "no GPUs registered"
        self._models_cache[shape] = found
        return found

    def _admit(self, job: Job, model: str) -> tuple[bool, bool, str]:
        borrowed = False
        gpus = job.spec.resources.total_gpus
        for adm in self.profile.admissions:
            v = adm.admit(job, model, gpus, self.ledger, self.config)
            if not v.ok:
                return False, False, v.reason
            borrowed = borrowed or v.borrowed
        return True, borrowed, ""

    def _max_tier(self, job: Job) -> int:
        t = job.spec.topology
        if not t.tier:
            return CLUSTER
        waited = self.now - (job.queued_at or job.created_at)
        if t.required or waited < t.wait_s:
            return TIER_INDEX[t.tier]
        return CLUSTER

    # -- finding room ------------------------------------------------------------------------------------
    def _node_ok(self, job: Job) -> Callable[[str], bool]:
        filters = [f for f in self.profile.node_filters if f.applies(job, self.config)]
        if not filters:
            return _always
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

    def _find(self, job: Job, pool: Pool) -> Found | None:
        r = job.spec.resources
        return pool.find(r.nodes, r.gpus_per_node, self._max_tier(job), self._node_ok(job), self._order(job, pool))

    def _find_now(self, job: Job, model: str) -> tuple[Found, list[_Held]] | None:
        pool = self.pools.get(model)
        if pool is None:
            return None
        found = self._find(job, pool)
        if found is not None:
            return found, []
        # Backfill into held GPUs, only for a job sure to end before the reservation starts.
        end = self.now + job.spec.time_limit_s if job.spec.time_limit_s > 0 else math.inf
        lent = [h for h in self.held if h.res.model == model and end <= h.res.start]
        if not lent:
            return None
        for h in lent:
            for node_id, gpus in h.lendable.items():
                pool.give(node_id, gpus)
        found = self._find(job, pool)
        for h in lent:
            for node_id, gpus in h.lendable.items():
                pool.take(node_id, gpus)
        return (found, lent) if found is not None else None

    def _decision(self, job: Job, model: str, borrowed: bool, found: Found, lent: Sequence[_Held]) -> Decision:
        r = job.spec.resources
        pool = self.pools[model]
        # Node ranks follow the topology: nodes of one leaf get consecutive ranks.
        ordered = sorted(found.nodes, key=lambda n: (self.paths[n][2], self.paths[n][1], self.paths[n][0], n))
        assignments = []
        single_island = True
        for node_rank, node_id in enumerate(ordered):
            islands = self._islands(node_id)
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
        return self._with_port(job, Decision(job.id, tuple(assignments), 0, model, borrowed, tier))

    def _islands(self, node_id: str) -> dict[int, int]:
        hit = self.islands.get(node_id)
        if hit is None:
            hit = self.islands[node_id] = islands_of(self.snap.nodes[node_id])
        return hit

    def _with_port(self, job: Job, d: Decision) -> Decision:
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
            for h in self.held:
                if a.node_id in h.lendable:
                    h.lendable[a.node_id] = [g for g in h.lendable[a.node_id] if g not in taken]
            pool.take(a.node_id, taken)
            self.ledger.charge(job.team, job.spec.queue, a.model, self._quota_key(job.team, a.model),
                               len(a.gpu_indices), d.borrowed)
        self.ports.setdefault(d.assignments[0].node_id, set()).add(d.master_port)
        self.result.decisions.append(d)

    def _place_cpu(self, job: Job) -> tuple[Decision | None, str]:
        r = job.spec.resources
        ok = self._node_ok(job)
        per_leaf: dict[str, list[str]] = {}
        for node_id in self.cpu_nodes:
            if ok(node_id):
                per_leaf.setdefault(self.paths[node_id][0], []).append(node_id)
        chosen = select_by_leaves(list(per_leaf.values()), r.nodes, lambda n: float(self.free_cpus[n]))
        if chosen is None:
            return None, (f"waiting for {r.nodes} CPU-only node(s) with {r.cpus_per_node or 1} free CPU(s); "
                          f"{sum(len(v) for v in per_leaf.values())} have room")
        ordered = sorted(chosen, key=lambda n: (self.paths[n][2], self.paths[n][1], self.paths[n][0], n))
        assignments = tuple(NodeAssignment(node_id=n, node_rank=i, gpu_indices=(), ranks=(i,), model="",
                                           cpus=r.cpus_per_node or 1) for i, n in enumerate(ordered))
        return self._with_port(job, Decision(job.id, assignments, 0, "", False, gang_tier(ordered, self.paths))), ""

    def _place_mixed(self, job: Job, admitted: Sequence[tuple[str, bool]]) -> Decision | None:
        """A gang allowed to mix models: each node's share is of one model (the fastest the node has)."""
        r = job.spec.resources
        ok = self._node_ok(job)
        best_model: dict[str, str] = {}
        for model, _ in admitted:  # fastest first
            pool = self.pools.get(model)
            if pool is None:
                continue
            for node_id, free in pool.free.items():
                if node_id not in best_model and len(free) >= r.gpus_per_node and ok(node_id):
                    best_model[node_id] = model
        per_leaf: dict[str, list[str]] = {}
        for node_id in best_model:
            per_leaf.setdefault(self.paths[node_id][0], []).append(node_id)
        chosen = select_by_leaves(list(per_leaf.values()), r.nodes, lambda n: float(len(self.pools[best_model[n]]
                                                                                       .free[n])))
        if chosen is None:
            return None
        tier = gang_tier(chosen, self.paths)
        if tier > self._max_tier(job):
            return None
        ordered = sorted(chosen, key=lambda n: (self.paths[n][2], self.paths[n][1], self.paths[n][0], n))
        assignments = []
        for node_rank, node_id in enumerate(ordered):
            model = best_model[node_id]
            gpus = pick_gpus(self.pools[model].free[node_id], r.gpus_per_node, self._islands(node_id))
            first = node_rank * r.gpus_per_node
            assignments.append(NodeAssignment(node_id, node_rank, gpus, tuple(range(first, first + r.gpus_per_node)),
                                              model=model, cpus=r.cpus_per_node))
        borrowed = any(b for _, b in admitted)
        models = sorted({a.model for a in assignments})
        return self._with_port(job, Decision(job.id, tuple(assignments), 0, models[0] if len(models) == 1 else
                                             "mixed", borrowed, tier))

    # -- search over releases (shared by reservations and preemption) -------------------------------------
    def _min_prefix(self, job: Job, pool: Pool, releases: Sequence[Release]) -> tuple[int, Found] | None:
        """The fewest releases, in the given order, after which the job fits in `pool`, and where. When no
        node filter applies to the job the pool's counts answer exactly, in one sweep; otherwise doubling
        then bisection over full searches, O(log n) of them. Leaves the pool as it was."""
        n = len(releases)
        r = job.spec.resources

        def apply(a: int, b: int, give: bool) -> None:
            for node_id, gpus in releases[a:b]:
                (pool.give if give else pool.take)(node_id, gpus)

        if self._node_ok(job) is _always:
            k = pool.first_fit([(node_id, len(g)) for node_id, g in releases], r.nodes, r.gpus_per_node,
                               self._max_tier(job))
            if k is None:
                return None
            apply(0, k, True)
            found = self._find(job, pool)
            apply(0, k, False)
            return (k, found) if found is not None else None

        def fits() -> bool:
            return self._find(job, pool) is not None

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
        found = self._find(job, pool)
        apply(0, hi, False)
        return (hi, found) if found is not None else None

    def _release_table(self, model: str) -> dict[str, list[Release]]:
        """What each running gang would give back of `model` (healthy GPUs on schedulable nodes); the index
        keeps these between sessions."""
        table = self._rel_cache.get(model)
        if table is None:
            table = {}
            for job_id, alloc in self.snap.allocations.items():
                rels = self.index.releases(job_id, alloc, model)
                if rels:
                    table[job_id] = rels
            self._rel_cache[model] = table
        return table

    # -- reservations (backfill guard) -----------------------------------------------------------------
    def _reserve(self, job: Job, admitted: Sequence[tuple[str, bool]]) -> None:
        if len(self.held) >= self.config.reservation_depth:
            return
        if self.reservation_tries >= self.config.reservation_depth + self.config.max_reservation_misses:
            return  # the jobs at the top cannot fit even when everything ends; the rest wait for a later cycle
        self.reservation_tries += 1
        ends: list[tuple[float, str, Allocation]] = []
        for alloc in self.snap.allocations.values():
            ends.append((expected_end(alloc, self.now), alloc.job_id, alloc))
        for d in self.result.decisions:
            limit = self.snap.jobs[d.job_id].spec.time_limit_s
            ends.append((self.now + limit if limit > 0 else math.inf, d.job_id,
                         Allocation(d.job_id, 0, d.assignments, "", 0, self.now)))
        ends.sort(key=lambda e: (e[0], e[1]))
        claimed = frozenset(n for h in self.held for n in h.res.nodes)
        best: tuple[float, int, str, Found] | None = None
        for rank, (model, _) in enumerate(admitted):
            pool = self.pools.get(model)
            if pool is None:
                continue
            table = self._release_table(model)
            releases: list[Release] = []
            times: list[float] = []
            for end, job_id, alloc in ends:
                rels = table.get(job_id) if job_id in self.snap.allocations else self.index.releases_of(alloc, model)
                for rel in rels or ():
                    if rel[0] not in claimed:
                        releases.append(rel)
                        times.append(end)
            hit = self._min_prefix_excluding(job, pool, releases, claimed)
            if hit is None:
                continue
            k, found = hit
            start = times[k - 1] if k else self.now
            if best is None or (start, rank) < (best[0], best[1]):
                best = (start, rank, model, found)
        if best is None:
            return
        start, _, model, found = best
        pool = self.pools[model]
        lendable: dict[str, list[int]] = {}
        need = job.spec.resources.gpus_per_node
        for node_id in found.nodes:
            free_now = pool.free.get(node_id, [])
            if free_now:
                hold = list(pick_gpus(free_now, min(need, len(free_now)), self._islands(node_id)))
                pool.take(node_id, hold)
                self.touched.add(node_id)
                lendable[node_id] = hold
        res = Reservation(job.id, start, found.nodes, model)
        self.held.append(_Held(res, lendable))
        self.result.reservations.append(res)

    def _min_prefix_excluding(self, job: Job, pool: Pool, releases: Sequence[Release],
                              claimed: frozenset[str]) -> tuple[int, Found] | None:
        if not claimed:
            return self._min_prefix(job, pool, releases)
        # Nodes another reservation holds are not offered to this one.
        saved = {n: list(pool.free[n]) for n in claimed if n in pool.free}
        for n in saved:
            pool.set_free(n, [])
        try:
            return self._min_prefix(job, pool, releases)
        finally:
            for n, free in saved.items():
                pool.set_free(n, free)

    # -- preemption --------------------------------------------------------------------------------------
    def _preempt(self, job: Job, admitted: Sequence[tuple[str, bool]]) -> bool:
        """Choose victims for a blocked job; True when a preemption was decided (or is under way)."""
        if job.id in self.nominated:
            return False  # its victims are still stopping; their GPUs come back to it then
        cls = self.config.priority_class(job.spec.priority_class)
        if not self.config.preemption or not cls.can_preempt:
            return False
        if self.preemptors >= self.config.max_preemptors:
            return False  # bounded work per session; the rest try again next cycle
        mine = standing(job.spec.queue, job.spec.priority_class, job.spec.priority, self.config)
        pool_all = self._victim_pool()
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
            pool = self.pools.get(model)
            if pool is None:
                continue
            table = self._release_table(model)
            releases: list[Release] = []
            owner: list[str] = []
            for _, job_id, _alloc in candidates:
                for rel in table.get(job_id, ()):
                    releases.append(rel)
                    owner.append(job_id)
            hit = self._min_prefix(job, pool, releases)
            if hit is None:
                continue
            k, found = hit
            victims = self._prune(job, pool, found, releases[:k], owner[:k])
            if not victims:
                continue
            self.victims_taken.update(victims)
            why = "reclaiming its team's quota" if not borrowed and not any(
                mine > self.snap.allocations[v].priority for v in victims) else "higher standing"
            self.result.preemptions.append(Preemption(job.id, tuple(victims), f"preempted by {job.id} ({why})"))
            return True
        return False

    def _victim_pool(self) -> list[tuple[tuple[float, ...], str, Allocation, tuple[int, int, int]]]:
        """Running gangs that could ever be preempted, cheapest first (computed once per session); the 4th
        element of every entry is the lowest standing among them."""
        if self._victims is None:
            cost = self.profile.victim_cost
            out = []
            for alloc in self.snap.allocations.values():
                victim = self.snap.jobs.get(alloc.job_id)
                if (victim is not None and not alloc.stop_reason and alloc.preemptible
                        and self.now >= self.config.exempt_until(alloc.created_at, len(victim.preempted_by))):
                    out.append((cost.cost(victim, alloc, self.now), alloc.job_id, alloc, alloc.priority))
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


def _always(node_id: str) -> bool:
    return True


class _Overlay(dict[str, int]):
    """A session's changes over the index's free CPUs, leaving the index's own dict untouched."""

    def __init__(self, base: dict[str, int]) -> None:
        super().__init__()
        self._base = base

    def __missing__(self, key: str) -> int:
        return self._base.get(key, 0)
