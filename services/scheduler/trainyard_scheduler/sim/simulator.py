"""A discrete-event simulator of the placement core: a trace of jobs runs on a fleet, placed by a
`place`-shaped function, with sim time passed in as `now`. Pure and deterministic: no clock (except the
optional `timer` used only to time `place` calls for the benchmark), no store, no I/O.

Events, in time order (ties: ends, then arrivals, then wake-ups, then a placement cycle):
- arrival: the job becomes PENDING.
- end: a gang finishes its work (SUCCEEDED), or reaches its time limit first (killed: FAILED).
- wake: a job's topology `wait_s` runs out, so the session may now place it more widely.
- cycle: one `place` call over a snapshot of the cluster (every node alive; jobs = pending + running;
  one allocation per running gang, with team, standing, borrowed, preemptible and expected end = start +
  time limit), then its decisions and preemptions are applied. A cycle runs when something changed, at
  most every `cycle_s` of sim time (this bounds the cost at 10k nodes); right after a preemption the next
  cycle is due `cycle_s` later so the preemptor can take the freed GPUs.

Applying a decision checks the gang is whole (every node gets exactly its share), on GPUs that exist,
are of a model the job accepts, and are held by no running gang — any violation raises
`SimulationError` at once. The gang runs at gpus x the job's true speed on its model (the slowest model
of a mixed gang). A preemption stops its victims at once: they lose the progress made since their last
checkpoint and are requeued as new PENDING attempts that remember their preemptor (`preempted_by`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from ..domain.jobs import admit, requeue, transition
from ..domain.models import Allocation, Job, JobState, Node
from ..domain.queues import PolicyConfig, standing
from ..domain.snapshot import ClusterSnapshot
from ..policy.api import ModelInfo, Profile
from ..policy.place import Decision, PlacementResult, place
from ..policy.plugins.accelerators import AcceleratorRequest
from ..policy.topology import NODE, optimal_tier
from .fleet import DomainSizes, domain_sizes
from .trace import TraceJob

Timer = Callable[[], float]


class PlaceFn(Protocol):
    def __call__(self, snapshot: ClusterSnapshot, profile: Profile, config: PolicyConfig, now: float,
                 port_range: tuple[int, int] = ..., timer: Timer | None = ...) -> PlacementResult: ...


class SimulationError(AssertionError):
    """An invariant of placement was broken (a GPU in two gangs, a partial gang, a refused model)."""


# Event kinds; the value orders events that fall at the same time.
_END, _ARRIVAL, _WAKE, _CYCLE = range(4)

# Job-size buckets for reporting, (label, smallest, largest) in GPUs.
BUCKETS: tuple[tuple[str, int, int], ...] = (
    ("1", 1, 1), ("2-8", 2, 8), ("9-64", 9, 64), ("65-512", 65, 512), ("513-1024", 513, 1024))


def bucket_of(gpus: int) -> str:
    for label, lo, hi in BUCKETS:
        if lo <= gpus <= hi:
            return label
    return f">{BUCKETS[-1][2]}" if gpus > BUCKETS[-1][2] else "0"


@dataclass
class JobRecord:
    job_id: str
    team: str
    gpus: int
    nodes: int
    submit: float
    state: JobState = JobState.PENDING
    first_start: float | None = None
    end: float | None = None
    # Per attempt that ran: start time, placement tier, model ("mixed" for a mixed gang).
    starts: list[float] = field(default_factory=list)
    tiers: list[int] = field(default_factory=list)
    models: list[str] = field(default_factory=list)
    # The tier an empty fleet could give it (multi-node gangs only; None otherwise).
    optimal_tiers: list[int | None] = field(default_factory=list)
    preemptions: int = 0
    # Time spent PENDING, over all attempts.
    wait: float = 0.0

    @property
    def jct(self) -> float | None:
        return None if self.end is None else self.end - self.submit

    @property
    def bucket(self) -> str:
        return bucket_of(self.gpus)


@dataclass(frozen=True, slots=True)
class CycleRecord:
    at: float
    pending: int           # jobs pending when the cycle started
    decisions: int
    preemptions: int
    reservations: int
    unplaced: int
    allocation: float      # GPUs held / healthy GPUs, after the cycle's decisions
    place_s: float = 0.0   # time inside place (only with a timer)
    jobs_s: float = 0.0    # of which spent on the jobs themselves (the sum of PlacementResult.timings)


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass
class SimResult:
    jobs: dict[str, JobRecord]
    cycles: list[CycleRecord]
    # (job id, seconds) per job considered by a timed `place` call.
    timings: list[tuple[str, float]]
    healthy_gpus: int
    end: float
    # The cluster between events: (start, duration, GPUs held, jobs and GPUs the latest cycle left blocked).
    intervals: list[tuple[float, float, int, int, int]] = field(default_factory=list)

    def select(self, keep: Callable[[JobRecord], bool]) -> SimResult:
        """The same run, with job figures over the jobs `keep` accepts (e.g. those submitted after a
        warm-up); cycle and allocation figures are unchanged."""
        return replace(self, jobs={k: r for k, r in self.jobs.items() if keep(r)})

    def finished(self) -> list[JobRecord]:
        return [r for r in self.jobs.values() if r.end is not None]

    def never_started(self) -> list[str]:
        return [r.job_id for r in self.jobs.values() if r.first_start is None]

    def average_jct(self) -> float:
        jcts = [r.jct for r in self.finished() if r.jct is not None]
        return sum(jcts) / len(jcts) if jcts else math.nan

    def jct_by_bucket(self) -> dict[str, float]:
        out: dict[str, list[float]] = {}
        for r in self.finished():
            if r.jct is not None:
                out.setdefault(r.bucket, []).append(r.jct)
        return {b: sum(v) / len(v) for b, v in out.items()}

    def waits_by_bucket(self) -> dict[str, list[float]]:
        """Time from submission to first start, per size bucket (jobs that started)."""
        out: dict[str, list[float]] = {}
        for r in self.jobs.values():
            if r.first_start is not None:
                out.setdefault(r.bucket, []).append(r.first_start - r.submit)
        return out

    def wait_percentile_by_bucket(self, q: float) -> dict[str, float]:
        return {b: _pct(v, q) for b, v in self.waits_by_bucket().items()}

    def mean_allocation_while_queued(self, min_queued_gpus: int = 1, since: float = -math.inf,
                                     until: float = math.inf) -> float:
        """Time-weighted share of healthy GPUs held while the latest cycle had left at least
        `min_queued_gpus` GPUs' worth of jobs blocked (between `since` and `until`)."""
        held = time = 0.0
        for start, dt, gpus, _, queued_gpus in self.intervals:
            if queued_gpus >= min_queued_gpus and since <= start < until:
                held += gpus * dt
                time += dt
        return held / (time * self.healthy_gpus) if time and self.healthy_gpus else math.nan

    def queued_time(self, min_queued_gpus: int = 1) -> float:
        return sum(dt for _, dt, _, _, q in self.intervals if q >= min_queued_gpus)

    def mean_allocation(self, since: float = -math.inf, until: float = math.inf) -> float:
        held = time = 0.0
        for start, dt, gpus, _, _ in self.intervals:
            if since <= start < until:
                held += gpus * dt
                time += dt
        return held / (time * self.healthy_gpus) if time and self.healthy_gpus else math.nan

    def tiers_over_optimal(self) -> list[int]:
        out: list[int] = []
        for r in self.jobs.values():
            for tier, best in zip(r.tiers, r.optimal_tiers, strict=True):
                if best is not None:
                    out.append(tier - best)
        return out

    def mean_tiers_over_optimal(self) -> float:
        xs = self.tiers_over_optimal()
        return sum(xs) / len(xs) if xs else math.nan

    def preemptions(self) -> int:
        return sum(r.preemptions for r in self.jobs.values())

    def failed(self) -> list[str]:
        return [r.job_id for r in self.jobs.values() if r.state is JobState.FAILED]


@dataclass
class _Running:
    trace: TraceJob
    attempt: int
    start: float
    rate: float        # GPU-seconds of work (at speed 1.0) done per second
    remaining: float   # work left when this attempt started


Observer = Callable[[ClusterSnapshot, PlacementResult, float], None]


class Simulator:
    """Runs traces on `nodes` with `place_fn` (the policy's `place`, or a baseline of the same shape)."""

    def __init__(self, nodes: Sequence[Node], profile: Profile, config: PolicyConfig, *,
                 place_fn: PlaceFn = place, cycle_s: float = 60.0, timer: Timer | None = None,
                 observer: Observer | None = None, port_range: tuple[int, int] = (29500, 29999)) -> None:
        self.nodes: Mapping[str, Node] = {n.node_id: n for n in nodes}
        self.alive = frozenset(self.nodes)
        self.profile = profile
        self.config = config
        self.place_fn = place_fn
        self.cycle_s = cycle_s
        self.timer = timer
        self.observer = observer
        self.port_range = port_range
        self.sizes: dict[str, DomainSizes] = domain_sizes(list(nodes))
        self.healthy_gpus = sum(1 for n in nodes for g in n.gpus if g.healthy)
        self._gpu_model = {(n.node_id, g.index): g.model for n in nodes for g in n.gpus}
        catalog: dict[str, ModelInfo] = {}
        for n in nodes:
            for g in n.gpus:
                catalog.setdefault(g.model, ModelInfo(g.model, g.vendor, g.memory_mb, g.compute_capability))
        self._catalog = catalog
        self._accepts = AcceleratorRequest()

    # -- the run ------------------------------------------------------------------------------------------
    def run(self, trace: Iterable[TraceJob], until: float = math.inf) -> SimResult:
        self.now = 0.0
        self.trace: dict[str, TraceJob] = {}
        self.pending: dict[str, Job] = {}
        self.running_jobs: dict[str, Job] = {}
        self.allocations: dict[str, Allocation] = {}
        self.runs: dict[str, _Running] = {}
        self.remaining: dict[str, float] = {}
        self.used: dict[str, set[int]] = {}
        self.held = 0
        self.records: dict[str, JobRecord] = {}
        self.cycles: list[CycleRecord] = []
        self.timings: list[tuple[str, float]] = []
        self._events: list[tuple[float, int, int, str, int]] = []
        self._seq = 0
        self._cycle_due: float | None = None
        self._last_cycle = -math.inf
        self._blocked = (0, 0)
        self._last_t: float | None = None
        self._intervals: list[tuple[float, float, int, int, int]] = []
        for tj in trace:
            if tj.job_id in self.trace:
                raise ValueError(f"duplicate job id {tj.job_id} in the trace")
            self.trace[tj.job_id] = tj
            self.records[tj.job_id] = JobRecord(tj.job_id, tj.team, tj.gpus, tj.spec.resources.nodes, tj.submit)
            self.remaining[tj.job_id] = tj.work
            self._push(tj.submit, _ARRIVAL, tj.job_id, 0)
        while self._events:
            t, kind, _, job_id, attempt = heapq.heappop(self._events)
            if t > until:
                break
            self._advance(t)
            changed = False
            if kind == _ARRIVAL:
                self._queue(self.trace[job_id].job())
                changed = True
            elif kind == _END:
                changed = self._end(job_id, attempt)
            elif kind == _WAKE:
                changed = job_id in self.pending and self.pending[job_id].attempt == attempt
            else:
                # A cycle's own decisions call for no new cycle: the next end or arrival brings one.
                self._cycle_due = None
                self._cycle()
            if changed:
                self._schedule_cycle()
        return SimResult(jobs=self.records, cycles=self.cycles, timings=self.timings,
                         healthy_gpus=self.healthy_gpus, end=self.now, intervals=self._intervals)

    def _push(self, at: float, kind: int, job_id: str = "", attempt: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._events, (at, kind, self._seq, job_id, attempt))

    def _schedule_cycle(self) -> None:
        if self._cycle_due is not None or not self.pending:
            return
        self._cycle_due = max(self.now, self._last_cycle + self.cycle_s)
        self._push(self._cycle_due, _CYCLE)

    def _advance(self, t: float) -> None:
        if self._last_t is not None and t > self._last_t:
            self._intervals.append((self._last_t, t - self._last_t, self.held, *self._blocked))
        self._last_t = t
        self.now = t

    def _queue(self, job: Job) -> None:
        self.pending[job.id] = job
        wait = job.spec.topology.wait_s
        if job.spec.topology.tier and not job.spec.topology.required and wait > 0:
            self._push(self.now + wait, _WAKE, job.id, job.attempt)

    # -- a placement cycle --------------------------------------------------------------------------------
    def snapshot(self) -> ClusterSnapshot:
        """The cluster as the scheduler would load it now."""
        if self.config.preemption:
            self._refresh_checkpoints()
        jobs: dict[str, Job] = {**self.pending, **self.running_jobs}
        return ClusterSnapshot(nodes=self.nodes, alive=self.alive, jobs=jobs, allocations=dict(self.allocations))

    def _refresh_checkpoints(self) -> None:
        """Each running job's latest checkpoint (preemption victims are chosen by the work they would lose)."""
        for job_id, run in self.runs.items():
            every = run.trace.checkpoint_s
            if every <= 0:
                continue
            saved = math.floor((self.now - run.start) / every) * every
            at = run.start + saved if saved > 0 else None
            job = self.running_jobs[job_id]
            if job.last_checkpoint_at != at:
                self.running_jobs[job_id] = replace(job, last_checkpoint_at=at)

    def _cycle(self) -> None:
        self._last_cycle = self.now
        if not self.pending:
            self._blocked = (0, 0)
            return
        snap = self.snapshot()
        pending = len(self.pending)
        timer = self.timer
        started = timer() if timer else 0.0
        result = self.place_fn(snap, self.profile, self.config, self.now, self.port_range, timer=timer)
        place_s = timer() - started if timer else 0.0
        if self.observer is not None:
            self.observer(snap, result, self.now)
        for p in result.preemptions:
            for victim in p.victims:
                self._preempt(victim, p.preemptor)
        for d in result.decisions:
            self._apply(d)
        self.timings.extend(result.timings)
        self.cycles.append(CycleRecord(self.now, pending, len(result.decisions), len(result.preemptions),
                                       len(result.reservations), len(result.unplaced),
                                       self.held / self.healthy_gpus if self.healthy_gpus else 0.0,
                                       place_s, sum(s for _, s in result.timings)))
        self._blocked = (len(self.pending), sum(j.spec.resources.total_gpus for j in self.pending.values()))
        if result.preemptions:
            # The preemptor takes the freed GPUs in the next cycle.
            self._cycle_due = self.now + self.cycle_s
            self._push(self._cycle_due, _CYCLE)

    # -- applying decisions -----------------------------------------------------------------------------
    def _apply(self, d: Decision) -> None:
        job_id = d.job_id
        job = self.pending.get(job_id)
        if job is None:
            raise SimulationError(f"decision for {job_id}, which is not pending")
        shares = d.assignments
        r = job.spec.resources
        if len(shares) != r.nodes or len({a.node_id for a in shares}) != r.nodes:
            raise SimulationError(f"{job_id}: gang of {r.nodes} node(s) placed on {len(shares)} share(s)")
        models: set[str] = set()
        for a in shares:
            if len(a.gpu_indices) != r.gpus_per_node or len(set(a.gpu_indices)) != r.gpus_per_node:
                raise SimulationError(f"{job_id}: share on {a.node_id} has GPUs {a.gpu_indices}, "
                                      f"needs {r.gpus_per_node}")
            taken = self.used.get(a.node_id, set())
            for g in a.gpu_indices:
                gpu_model = self._gpu_model.get((a.node_id, g))
                if gpu_model is None:
                    raise SimulationError(f"{job_id}: GPU {g} does not exist on {a.node_id}")
                if g in taken:
                    raise SimulationError(f"{job_id}: GPU {g} on {a.node_id} is already in a running gang")
                models.add(gpu_model)
        for m in models:
            why = self._accepts.filter(job, self._catalog[m])
            if why is not None:
                raise SimulationError(f"{job_id}: placed on {m}, which it refuses ({why})")
        for a in shares:
            self.used.setdefault(a.node_id, set()).update(a.gpu_indices)
        self.held += r.total_gpus
        tj = self.trace[job_id]
        now = self.now
        placement = shares
        started = transition(admit(job, placement, now), JobState.RUNNING, now, "running (simulated)")
        del self.pending[job_id]
        self.running_jobs[job_id] = started
        spec = job.spec
        limit = spec.time_limit_s
        self.allocations[job_id] = Allocation(
            job_id=job_id, attempt=job.attempt, assignments=placement,
            master_addr=self.nodes[placement[0].node_id].worker_address, master_port=d.master_port, created_at=now,
            team=job.team, priority=standing(spec.queue, spec.priority_class, spec.priority, self.config),
            borrowed=d.borrowed, preemptible=self.config.priority_class(spec.priority_class).preemptible,
            expected_end=now + limit if limit > 0 else None)
        rate = r.total_gpus * min(tj.speed(m) for m in models)
        remaining = self.remaining[job_id]
        self.runs[job_id] = _Running(tj, job.attempt, now, rate, remaining)
        need = remaining / rate
        if limit > 0 and need > limit:
            self._push(now + limit, _END, job_id, job.attempt)
        else:
            self._push(now + need, _END, job_id, job.attempt)
        rec = self.records[job_id]
        rec.wait += now - job.queued_at
        if rec.first_start is None:
            rec.first_start = now
        rec.starts.append(now)
        rec.tiers.append(d.tier)
        rec.models.append(next(iter(models)) if len(models) == 1 else "mixed")
        rec.optimal_tiers.append(self._optimal(r.nodes, next(iter(models)) if len(models) == 1 else ""))

    def _optimal(self, nodes: int, model: str) -> int | None:
        if nodes <= 1:
            return None
        s = self.sizes.get(model) or self.sizes[""]
        best = optimal_tier(nodes, s.leaf, s.spine, s.zone)
        return best if best > NODE else None

    def _release(self, job_id: str) -> _Running:
        alloc = self.allocations.pop(job_id)
        for a in alloc.assignments:
            self.used[a.node_id].difference_update(a.gpu_indices)
        self.held -= alloc.gpus
        return self.runs.pop(job_id)

    def _end(self, job_id: str, attempt: int) -> bool:
        run = self.runs.get(job_id)
        if run is None or run.attempt != attempt:
            return False  # a stale event of an attempt that was preempted
        self._release(job_id)
        job = self.running_jobs.pop(job_id)
        done = run.remaining - (self.now - run.start) * run.rate
        rec = self.records[job_id]
        if done > 1e-6 * max(1.0, run.remaining):
            final = transition(job, JobState.FAILED, self.now, f"time limit of {job.spec.time_limit_s:g}s exceeded")
        else:
            final = transition(job, JobState.SUCCEEDED, self.now, "all workers exited 0 (simulated)")
        self.remaining[job_id] = max(0.0, done)
        rec.state = final.state
        rec.end = self.now
        return True

    def _preempt(self, job_id: str, preemptor: str) -> None:
        run = self.runs.get(job_id)
        if run is None:
            raise SimulationError(f"preemption of {job_id}, which is not running")
        self._release(job_id)
        job = self.running_jobs.pop(job_id)
        every = run.trace.checkpoint_s
        ran = self.now - run.start
        saved = math.floor(ran / every) * every if every > 0 else 0.0
        self.remaining[job_id] = max(0.0, run.remaining - saved * run.rate)
        stopped = transition(job, JobState.PREEMPTED, self.now, f"preempted by {preemptor}")
        again = requeue(stopped, self.now, f"requeued after preemption by {preemptor}")
        again = replace(again, preempted_by=(*job.preempted_by, preemptor)[-20:])
        self.records[job_id].preemptions += 1
        self._queue(again)
