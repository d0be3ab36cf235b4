"""Scheduler: the pure placement core on a simulated 10,000-node, 80,000-GPU fleet (3 GPU models from 2
vendors, leaf/spine/zone topology), and the gang commit against a real etcd. See docs/scheduler-benchmark.md.

Parts, all in one run:
1. Simulation (trainyard_scheduler.sim) of one synthetic trace on the fleet, twice: with our policy
   (`policy.place.place`, default profile and settings) and with type-unaware gang FIFO (sim/baseline.py).
   Job figures are over the jobs submitted after a warm-up (the first WARMUP_SHARE of the arrival span,
   while the fleet fills up from empty); both policies are measured on the same jobs.
2. Placement time: every `place` call of the simulation is timed (perf_counter around the call, and
   per job through place's `timer` argument). `decisions_per_s` = decisions / total time inside place;
   `index_build_ms` = per cycle, place time minus the per-job timings (the session's index of free
   capacity, built from the snapshot every call).
3. Latency of 128-node (1,024-GPU) topology-constrained gangs: every consideration of such a job in the
   simulation, plus a burst of `burst_jobs` such gangs (spine or zone; wait or required; high and normal
   class) added to the busiest snapshot of the run, so most of them take the slow paths (preemption
   search, reservation) on a nearly full fleet.
4. Commit: a real etcd (trainyard_core.testing.etcd). (a) raw `Store.txn` of the gang commit's shape
   (2 compares + 2 puts, the very bytes of the encoded job and allocation records), (b)
   `Repository.commit_placement` of the same decisions (job records created first); both with
   COMMIT_CONCURRENCY in flight (asyncio.gather behind a semaphore, as the reconciler commits),
   alternating rounds of (a) and (b) so noise hits both.
5. Commit over TLS: `Repository.commit_placement` of the same decisions to a plaintext etcd and to one that
   serves TLS only, requires client certificates and has auth on (the services' user logging in as its
   certificate's CN, role limited to the prefix, as the local cluster and deploy/ run it), in alternating
   rounds: `commit_tls_vs_plaintext` = TLS commits/s / plaintext commits/s, the median over the rounds of
   each round's ratio (`_overall`: of the totals).

The sizes (fleet, trace lengths, burst, backlog, commits) are `Config`; TINY runs every part on a 1,024-node
fleet in seconds, for tests/bench/, and its figures say nothing about the targets.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import math
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import cast

from trainyard_core import gc_tuning
from trainyard_core.security import pki
from trainyard_core.store import Compare, KeyValue, Put, absent, mod_revision_is
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.store.etcd_options import EtcdOptions
from trainyard_core.store.limits import txn_ops_limit
from trainyard_core.testing import etcd as etcd_proc
from trainyard_core.testing.etcd_auth import ROOT, enable_auth
from trainyard_scheduler.domain.jobs import admit
from trainyard_scheduler.domain.models import Allocation, Job, JobSpec, JobState, Node, Resources, TopologyRequest
from trainyard_scheduler.domain.queues import PolicyConfig, standing
from trainyard_scheduler.domain.snapshot import ClusterSnapshot
from trainyard_scheduler.policy.index import ClusterIndex
from trainyard_scheduler.policy.place import Decision, PlacementResult, place
from trainyard_scheduler.policy.registry import build_profile
from trainyard_scheduler.settings import SchedulerSettings
from trainyard_scheduler.sim import FleetShape, SimResult, Simulator, TraceJob, gang_fifo, make_fleet, synthetic_trace
from trainyard_scheduler.sim.simulator import BUCKETS, PlaceFn
from trainyard_scheduler.state.codec import encode_allocation, encode_job
from trainyard_scheduler.state.holdings import encode_holding, gpus_by_node
from trainyard_scheduler.state.keys import Keys
from trainyard_scheduler.state.repository import Repository

GPUS_PER_NODE = 8
SEED = 7
MEDIAN_RUNTIME_S = 900.0   # at speed 1.0 (A100), for a 1-GPU job; bigger jobs run longer
CYCLE_S = 60.0             # at most one placement cycle per simulated minute
WARMUP_SHARE = 0.25        # job figures skip the jobs submitted while the fleet fills up from empty
# The comparison run. LOAD is offered work / fleet throughput (speed-factor units). At 0.5 type-unaware FIFO
# holds ~83% of the GPUs and its queue stays bounded; from ~0.6 on it saturates (mixed-model gangs run at
# their slowest model) and its queue grows for as long as the trace lasts, so a JCT ratio there measures the
# trace's length as much as the policies. HIGH_LOAD is reported beside it, flagged by fifo_pending_growth.
LOAD = 0.5
HIGH_LOAD = 0.6
# The saturation run (ours only): more work than the fleet can serve, to see allocation under a standing
# queue and whether big jobs still get through. Measured from 40% of its arrival span.
SAT_LOAD = 1.2
BIG_NODES = 128
ROUNDS = 8                 # the commits of each arm are made in this many alternating rounds
COMMIT_CONCURRENCY = 64
TLS_ROUNDS = 24            # the TLS comparison's rounds (fewer when there are too few commits to fill them)

TARGETS = {
    "decisions_per_s": (">=", 1000.0),
    "p99_decision_ms_128node": ("<=", 100.0),
    "commit_vs_etcd_txn": (">=", 0.8),
    "commit_tls_vs_plaintext": (">=", 1 / 1.2),
    "jct_vs_fifo": ("<=", 1 / 1.5),
    "allocation_percent": (">=", 90.0),
}


@dataclass(frozen=True)
class Config:
    nodes: int = 10_000
    trace_jobs: int = 20_000   # the comparison runs (at LOAD and at HIGH_LOAD)
    sat_jobs: int = 9_000      # the saturation run
    burst_jobs: int = 64
    backlog_jobs: int = 3_000
    commits: int = 2_400       # per arm, in ROUNDS alternating rounds


# Enough saturation-run jobs that the fleet spends time >= 5% queued and big jobs finish (no empty figures).
TINY = Config(nodes=1_024, trace_jobs=600, sat_jobs=1_000, burst_jobs=8, backlog_jobs=200, commits=160)


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass
class _Capture:
    """What the benchmark keeps from the simulation's cycles: the first `wanted` decisions, to commit to
    etcd, and the busiest snapshot for the 128-node burst.

    The commits never release a gang, so all of them hold their GPUs at once, and the store refuses a GPU in
    two gangs; but a later cycle reuses the GPUs of gangs that ended in the simulation (only ~300 of the
    first decisions at full size are GPU-disjoint). A decision that would take a GPU an earlier one kept
    is moved, whole, onto copies of its nodes (`node-0009~1`, the first copy free for all its GPUs): the
    same gang shape, the same holdings compares and writes, as if the fleet were big enough for them all.
    `copies` maps each copy to its node."""

    wanted: int
    commits: list[tuple[Job, Decision, float]]
    busiest: tuple[int, ClusterSnapshot, float] | None = None
    held: set[tuple[str, int]] = field(default_factory=set)  # (node or copy, GPU index)
    copies: dict[str, str] = field(default_factory=dict)
    moved: int = 0

    def __call__(self, snap: ClusterSnapshot, result: PlacementResult, now: float) -> None:
        seen = {j.id for j, _, _ in self.commits}
        for d in result.decisions:
            if len(self.commits) >= self.wanted or d.job_id in seen:
                continue
            copy = 0
            while any((_copy_of(a.node_id, copy), g) in self.held for a in d.assignments for g in a.gpu_indices):
                copy += 1
            if copy:
                self.moved += 1
                moved = tuple(replace(a, node_id=_copy_of(a.node_id, copy)) for a in d.assignments)
                self.copies.update({m.node_id: a.node_id for m, a in zip(moved, d.assignments, strict=True)})
                d = replace(d, assignments=moved)
            self.held.update((a.node_id, g) for a in d.assignments for g in a.gpu_indices)
            self.commits.append((snap.jobs[d.job_id], d, now))
            seen.add(d.job_id)
        held = sum(a.gpus for a in snap.allocations.values())
        if self.busiest is None or held > self.busiest[0]:
            self.busiest = (held, snap, now)


def _copy_of(node_id: str, copy: int) -> str:
    return f"{node_id}~{copy}" if copy else node_id


def _big_constrained(spec: JobSpec) -> bool:
    return spec.resources.nodes == BIG_NODES and spec.topology.tier in ("spine", "zone")


def _burst(snap: ClusterSnapshot, now: float, config: PolicyConfig,
           burst_jobs: int) -> tuple[list[float], PlacementResult, float]:
    jobs = dict(snap.jobs)
    kinds = [TopologyRequest("spine", wait_s=1800.0), TopologyRequest("spine", required=True),
             TopologyRequest("zone", wait_s=1800.0), TopologyRequest("zone", required=True)]
    ids = []
    for i in range(burst_jobs):
        spec = JobSpec(name=f"burst-{i}", command=("python", "train.py"),
                       resources=Resources(nodes=BIG_NODES, gpus_per_node=GPUS_PER_NODE),
                       priority_class="high" if i % 2 else "", time_limit_s=7200.0, topology=kinds[i % len(kinds)])
        job = Job(id=f"burst-{i:03d}", spec=spec, state=JobState.PENDING,
                  team=f"team-{'abcd'[i % 4]}", user="bench", created_at=now - 1.0, updated_at=now - 1.0,
                  queued_at=now - 1.0)
        jobs[job.id] = job
        ids.append(job.id)
    burst = replace(snap, jobs=jobs)
    t0 = time.perf_counter()
    result = place(burst, build_profile(), config, now, timer=time.perf_counter)
    total = time.perf_counter() - t0
    wanted = set(ids)
    return [s for j, s in result.timings if j in wanted], result, total


def _backlog(nodes_n: int, jobs_n: int, config: PolicyConfig) -> tuple[int, float, float]:
    """One session over a backlog on an empty fleet: decisions, seconds inside place, per-job seconds."""
    nodes = make_fleet(nodes_n, GPUS_PER_NODE)
    trace = synthetic_trace(jobs_n, SEED + 1, load=LOAD, median_runtime_s=MEDIAN_RUNTIME_S)
    snap = ClusterSnapshot(nodes={n.node_id: n for n in nodes}, alive=frozenset(n.node_id for n in nodes),
                           jobs={t.job_id: t.job() for t in trace}, allocations={})
    t0 = time.perf_counter()
    result = place(snap, build_profile(), config, trace[-1].submit, timer=time.perf_counter)
    return len(result.decisions), time.perf_counter() - t0, sum(s for _, s in result.timings)


# --- etcd ----------------------------------------------------------------------------------------------

def _records(captured: Sequence[tuple[Job, Decision, float]], nodes: dict[str, str],
             config: PolicyConfig) -> list[tuple[Job, Job, Allocation]]:
    """(pending job, admitted job, allocation) per decision, built as the reconciler builds them."""
    out = []
    for job, d, now in captured:
        spec = job.spec
        alloc = Allocation(job_id=job.id, attempt=job.attempt, assignments=d.assignments,
                           master_addr=nodes[d.assignments[0].node_id], master_port=d.master_port, created_at=now,
                           team=job.team, priority=standing(spec.queue, spec.priority_class, spec.priority, config),
                           borrowed=d.borrowed, preemptible=config.priority_class(spec.priority_class).preemptible,
                           expected_end=now + spec.time_limit_s if spec.time_limit_s > 0 else None)
        out.append((job, admit(job, d.assignments, now), alloc))
    return out


async def _gather(n: int, call: Callable[[int], Awaitable[object]]) -> float:
    gate = asyncio.Semaphore(COMMIT_CONCURRENCY)

    async def one(i: int) -> None:
        async with gate:
            await call(i)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return time.perf_counter() - t0


def _offset(call: Callable[[int], Awaitable[None]], lo: int, i: int) -> Awaitable[None]:
    return call(lo + i)


async def _commit_bench(records: list[tuple[Job, Job, Allocation]], endpoint: str) -> dict[str, float]:
    """Three arms over the same decisions, each under its own key prefix, in alternating rounds:
    raw (`Store.txn` with the records' bytes encoded beforehand), raw+encode (the same with the JSON encoding
    inside the timed part), and `Repository.commit_placement` as the leader runs it: the GPU holdings of every
    node of the gang compared and written in the same transaction, gangs waiting on a busy node merged. The
    holdings come from what the repository's ledger wrote; a node it never wrote is absent on this fresh
    prefix, as the leader's mirror would say (the mirror's own watch processing, which the leader pays for
    every key anyway, is not in the timed part of any arm). The raw arms keep the shape without holdings,
    so `commit_vs_etcd_txn` prices them in; the `guarded` arm sends the holdings shape raw. The process's
    garbage collector is tuned as the scheduler's main tunes it (`gc_tuning`), for every arm."""
    store = EtcdStore(endpoint)
    thresholds = gc.get_threshold()
    gc_tuning.tune()
    try:
        run_id = uuid.uuid4().hex[:8]
        keys = {arm: Keys(f"/bench-{run_id}/{arm}") for arm in ("raw", "guarded", "encode", "repo")}
        async def fresh_prefix(key: str) -> KeyValue | None:
            return None
        repo = Repository(store, keys["repo"], holdings_source=fresh_prefix,
                          max_txn_ops=await txn_ops_limit(store, keys["repo"].leader, 10_000))
        payloads = [(encode_job(pending), encode_job(admitted), encode_allocation(alloc))
                    for pending, admitted, alloc in records]
        # The holdings each gang writes, for the raw arm of the same shape (one compare and write per node).
        holdings = [[(node_id, encode_holding({admitted.id: gpus})) for node_id, gpus in gpus_by_node(alloc).items()]
                    for _, admitted, alloc in records]
        # Setup (not timed): the pending job records every arm compares against.
        for arm in ("raw", "guarded", "encode"):
            prefix = keys[arm]

            async def put_pending(i: int, k: Keys = prefix) -> None:
                await store.put(k.job(records[i][0].id), payloads[i][0])
            await _gather(len(records), put_pending)
        await _gather(len(records), lambda i: repo.create_job(records[i][0]))
        revs: dict[str, dict[str, int]] = {}
        for arm, k in keys.items():
            page = await store.range(k.jobs)
            revs[arm] = {kv.key.rsplit("/", 1)[1]: kv.mod_revision for kv in page.kvs}

        failures = 0

        async def raw(i: int) -> None:
            nonlocal failures
            job_id, k = records[i][0].id, keys["raw"]
            res = await store.txn([mod_revision_is(k.job(job_id), revs["raw"][job_id]), absent(k.allocation(job_id))],
                                  [Put(k.job(job_id), payloads[i][1]), Put(k.allocation(job_id), payloads[i][2])])
            failures += not res.succeeded

        async def guarded(i: int) -> None:
            # The transaction commit_placement sends, raw: its holdings compares always hold here, so the
            # arms' order cannot make it fail; etcd does the same work per operation.
            nonlocal failures
            job_id, k = records[i][0].id, keys["guarded"]
            res = await store.txn([mod_revision_is(k.job(job_id), revs["guarded"][job_id]),
                                   absent(k.allocation(job_id)),
                                   *(Compare(k.holdings(n), "version", ">", -1) for n, _ in holdings[i])],
                                  [Put(k.job(job_id), payloads[i][1]), Put(k.allocation(job_id), payloads[i][2]),
                                   *(Put(k.holdings(n), v) for n, v in holdings[i])])
            failures += not res.succeeded

        async def encode(i: int) -> None:
            nonlocal failures
            _, admitted, alloc = records[i]
            job_id, k = admitted.id, keys["encode"]
            res = await store.txn([mod_revision_is(k.job(job_id), revs["encode"][job_id]),
                                   absent(k.allocation(job_id))],
                                  [Put(k.job(job_id), encode_job(admitted)),
                                   Put(k.allocation(job_id), encode_allocation(alloc))])
            failures += not res.succeeded

        async def commit(i: int) -> None:
            _, admitted, alloc = records[i]
            await repo.commit_placement(admitted, revs["repo"][admitted.id], alloc)

        arms: dict[str, Callable[[int], Awaitable[None]]] = {"raw": raw, "guarded": guarded, "encode": encode,
                                                              "repo": commit}
        took = dict.fromkeys(arms, 0.0)
        per_round = len(records) // ROUNDS
        for r in range(ROUNDS):
            order = list(arms) if r % 2 == 0 else list(reversed(arms))
            for arm in order:
                took[arm] += await _gather(per_round, functools.partial(_offset, arms[arm], r * per_round))
        n = per_round * ROUNDS
        if failures:
            raise RuntimeError(f"{failures} raw transactions failed their compares")
        sizes = [len(p[1]) + len(p[2]) for p in payloads]
        return {"etcd_txn_per_s": n / took["raw"], "etcd_txn_with_encode_per_s": n / took["encode"],
                "etcd_txn_with_holdings_per_s": n / took["guarded"],
                # Transactions the commit arm sent, and how many of them carried gangs that waited on a node.
                "commit_txns": float(repo.holdings_writes.batches),
                "commit_txns_merged": float(repo.holdings_writes.merged),
                "commit_per_s": n / took["repo"], "commits_each": float(n),
                "commit_payload_bytes_mean": statistics.mean(sizes),
                "commit_payload_bytes_max": float(max(sizes))}
    finally:
        gc.set_threshold(*thresholds)
        await store.close()


async def _commit_tls_bench(records: list[tuple[Job, Job, Allocation]], plain: EtcdOptions,
                            tls: EtcdOptions, prefix: str) -> dict[str, float]:
    """`Repository.commit_placement` of the same decisions through a store to the plaintext etcd and one to
    the TLS etcd, each under its own prefix, in alternating rounds (the order flipped every round)."""
    stores = {"plaintext": EtcdStore.from_options(plain), "tls": EtcdStore.from_options(tls)}
    thresholds = gc.get_threshold()
    gc_tuning.tune()
    try:
        async def fresh_prefix(key: str) -> KeyValue | None:
            return None
        repos: dict[str, Repository] = {}
        revs: dict[str, dict[str, int]] = {}
        for arm, store in stores.items():
            keys = Keys(f"{prefix}{arm}")
            repo = repos[arm] = Repository(store, keys, holdings_source=fresh_prefix,
                                           max_txn_ops=await txn_ops_limit(store, keys.leader, 10_000))

            async def create(i: int, repo: Repository = repo) -> None:
                await repo.create_job(records[i][0])
            await _gather(len(records), create)  # setup, not timed
            page = await store.range(keys.jobs)
            revs[arm] = {kv.key.rsplit("/", 1)[1]: kv.mod_revision for kv in page.kvs}

        def committer(arm: str) -> Callable[[int], Awaitable[None]]:
            async def commit(i: int) -> None:
                _, admitted, alloc = records[i]
                await repos[arm].commit_placement(admitted, revs[arm][admitted.id], alloc)
            return commit
        took = dict.fromkeys(stores, 0.0)
        ratios = []  # per round: this machine's noise comes in bursts, and a burst hits one round of each arm
        rounds = TLS_ROUNDS if len(records) >= TLS_ROUNDS * COMMIT_CONCURRENCY else ROUNDS
        per_round = len(records) // rounds
        for r in range(rounds):
            this = {}
            for arm in (list(stores) if r % 2 == 0 else list(reversed(stores))):
                this[arm] = await _gather(per_round, functools.partial(_offset, committer(arm), r * per_round))
                took[arm] += this[arm]
            ratios.append(this["plaintext"] / this["tls"])
        n = per_round * rounds
        return {"commit_per_s_plaintext_etcd": n / took["plaintext"], "commit_per_s_tls_etcd": n / took["tls"],
                "commit_tls_vs_plaintext": statistics.median(ratios),
                "commit_tls_vs_plaintext_overall": took["plaintext"] / took["tls"],
                "commit_tls_rounds": float(rounds)}
    finally:
        gc.set_threshold(*thresholds)
        for store in stores.values():
            await store.close()


def commit_over_tls(records: list[tuple[Job, Job, Allocation]]) -> dict[str, float]:
    """Part 5 on its own etcd pair: one plaintext member, one with TLS, client certificates and auth on."""
    with tempfile.TemporaryDirectory(prefix="trainyard-bench-pki-") as tmp:
        server, users = pki.ensure_etcd(Path(tmp), [ROOT, "trainyard"])
        plain = etcd_proc.start_single()
        secure = etcd_proc.start_single(tls=server)
        try:
            enable_auth(secure.endpoint, users[ROOT], "/bench/", {"trainyard": None})
            mine = users["trainyard"]
            return asyncio.run(_commit_tls_bench(
                records, EtcdOptions(endpoints=plain.endpoint),
                EtcdOptions(endpoints=secure.endpoint, ca_file=mine.ca, cert_file=mine.cert, key_file=mine.key),
                f"/bench/tls-{uuid.uuid4().hex[:8]}/"))
        finally:
            etcd_proc.stop_and_clean(plain)
            etcd_proc.stop_and_clean(secure)


# --- the run -------------------------------------------------------------------------------------------

def _kept_index_place() -> PlaceFn:
    """`place` with its index of free capacity kept from one call to the next, as the reconciler keeps it."""
    return cast(PlaceFn, functools.partial(place, index=ClusterIndex(build_profile().gates)))


def _full_index_build_ms(snap: ClusterSnapshot) -> float:
    gates = build_profile().gates
    took = []
    for _ in range(3):
        t0 = time.perf_counter()
        ClusterIndex.of(snap, gates)
        took.append(time.perf_counter() - t0)
    return min(took) * 1000


def _simulate(nodes: list[Node], trace: list[TraceJob], config: PolicyConfig, ours: bool,
              capture: _Capture | None) -> tuple[SimResult, float]:
    t0 = time.perf_counter()
    sim = Simulator(nodes, build_profile(), config, place_fn=_kept_index_place() if ours else gang_fifo(),
                    cycle_s=CYCLE_S, timer=time.perf_counter if ours else None, observer=capture)
    result = sim.run(trace)
    return result, time.perf_counter() - t0


def _window(trace: Sequence[TraceJob], warm_share: float) -> tuple[float, float]:
    first, last = trace[0].submit, trace[-1].submit
    return first + warm_share * (last - first), last


@dataclass
class _Comparison:
    trace: list[TraceJob]
    ours: SimResult
    fifo: SimResult
    ours_m: SimResult  # job figures over the jobs submitted after the warm-up
    fifo_m: SimResult
    warm_until: float
    arrivals_end: float
    ours_s: float
    fifo_s: float

    @property
    def jct_ratio(self) -> float:
        return self.ours_m.average_jct() / self.fifo_m.average_jct()

    def fifo_pending_growth(self) -> float:
        """FIFO's queue over the last third of the measured window / the first third: ~1 when bounded."""
        third = (self.arrivals_end - self.warm_until) / 3
        return (_mean_pending(self.fifo, self.arrivals_end - third, self.arrivals_end)
                / max(1.0, _mean_pending(self.fifo, self.warm_until, self.warm_until + third)))


def _compare(nodes: list[Node], shape: FleetShape, config: PolicyConfig, load: float, jobs: int,
             capture: _Capture | None) -> _Comparison:
    trace = synthetic_trace(jobs, SEED, load=load, shape=shape, median_runtime_s=MEDIAN_RUNTIME_S)
    warm_until, arrivals_end = _window(trace, WARMUP_SHARE)
    ours, ours_s = _simulate(nodes, trace, config, True, capture)
    fifo, fifo_s = _simulate(nodes, trace, config, False, None)
    measured = {t.job_id for t in trace if t.submit >= warm_until}
    return _Comparison(trace, ours, fifo, ours.select(lambda r: r.job_id in measured),
                       fifo.select(lambda r: r.job_id in measured), warm_until, arrivals_end, ours_s, fifo_s)


def run(size: Config = Config()) -> dict[str, float]:
    t_start = time.perf_counter()
    # Exactly the scheduler's default policy settings (classes, speed factors, reservation depth 1,
    # preemption on with its exemption).
    config = SchedulerSettings.model_validate({}).policy()
    shape = FleetShape(nodes=size.nodes, gpus_per_node=GPUS_PER_NODE)
    nodes = make_fleet(size.nodes, GPUS_PER_NODE, shape=shape)

    # 1. The comparison runs: one trace per load, our policy and FIFO on each.
    capture = _Capture(size.commits, [])
    main = _compare(nodes, shape, config, LOAD, size.trace_jobs, capture)
    high = _compare(nodes, shape, config, HIGH_LOAD, size.trace_jobs, None)
    ours, ours_m, fifo, fifo_m = main.ours, main.ours_m, main.fifo, main.fifo_m

    # 2. The saturation run: ours alone, offered more than the fleet serves.
    sat_trace = synthetic_trace(size.sat_jobs, SEED + 2, load=SAT_LOAD, shape=shape, median_runtime_s=MEDIAN_RUNTIME_S)
    sat_from, sat_until = _window(sat_trace, 0.4)
    sat, sat_s = _simulate(nodes, sat_trace, config, True, None)
    sat_m = sat.select(lambda r: sat_from <= r.submit <= sat_until)

    # 3. Placement time.
    decisions = sum(c.decisions for c in ours.cycles)
    place_s = sum(c.place_s for c in ours.cycles)
    jobs_s = sum(c.jobs_s for c in ours.cycles)
    index_ms = [(c.place_s - c.jobs_s) * 1000 for c in ours.cycles]
    by_id = {t.job_id: t for t in main.trace}
    sat_by_id = {t.job_id: t for t in sat_trace}
    main_big = [s for j, s in ours.timings if _big_constrained(by_id[j].spec)]
    sat_big = [s for j, s in sat.timings if _big_constrained(sat_by_id[j].spec)]
    assert capture.busiest is not None
    _, busy_snap, busy_now = capture.busiest
    burst_big, burst_result, burst_s = _burst(busy_snap, busy_now, config, size.burst_jobs)
    backlog_decisions, backlog_s, backlog_jobs_s = _backlog(size.nodes, size.backlog_jobs, config)
    full_index_ms = _full_index_build_ms(busy_snap)
    sat_decisions = sum(c.decisions for c in sat.cycles)
    sat_place_s = sum(c.place_s for c in sat.cycles)

    # 4. Commits against a real etcd.
    member = etcd_proc.start_single()
    try:
        node_addr = {n.node_id: n.worker_address for n in nodes}
        node_addr.update({c: node_addr[n] for c, n in capture.copies.items()})
        records = _records(capture.commits, node_addr, config)
        etcd = asyncio.run(_commit_bench(records, member.endpoint))
    finally:
        etcd_proc.stop_and_clean(member)
    # 5. The same commits over TLS with auth, against plaintext.
    etcd.update(commit_over_tls(records))

    big = main_big + sat_big + burst_big
    figures: dict[str, float] = {
        "decisions_per_s": decisions / place_s,
        "decisions_per_s_excluding_index": decisions / jobs_s,
        "decisions_per_s_saturated": sat_decisions / sat_place_s,
        "index_build_ms": statistics.mean(index_ms),
        "index_build_ms_p99": _pct(index_ms, 0.99),
        "index_full_build_ms": full_index_ms,
        "place_call_ms_mean": place_s / len(ours.cycles) * 1000,
        "place_call_ms_mean_saturated": sat_place_s / len(sat.cycles) * 1000,
        "decisions_per_cycle": decisions / len(ours.cycles),
        "decisions_per_s_backlog": backlog_decisions / backlog_s,
        "backlog_decisions": float(backlog_decisions),
        "backlog_jobs": float(size.backlog_jobs),
        "backlog_job_ms_mean": backlog_jobs_s / size.backlog_jobs * 1000,
        "p99_decision_ms_128node": _pct(big, 0.99) * 1000,
        "p50_decision_ms_128node": _pct(big, 0.5) * 1000,
        "p99_decision_ms_128node_main": _pct(main_big, 0.99) * 1000,
        "p99_decision_ms_128node_saturated": _pct(sat_big, 0.99) * 1000,
        "p99_decision_ms_128node_burst": _pct(burst_big, 0.99) * 1000,
        "samples_128node": float(len(big)),
        "samples_128node_main": float(len(main_big)),
        "samples_128node_saturated": float(len(sat_big)),
        "samples_128node_burst": float(len(burst_big)),
        "burst_placed": float(sum(1 for d in burst_result.decisions if d.job_id.startswith("burst-"))),
        "burst_preemptions": float(sum(1 for p in burst_result.preemptions if p.preemptor.startswith("burst-"))),
        "burst_place_call_ms": burst_s * 1000,
        "mean_tiers_over_optimal": ours_m.mean_tiers_over_optimal(),
        "mean_tiers_over_optimal_fifo": fifo_m.mean_tiers_over_optimal(),
        "jct_s": ours_m.average_jct(),
        "jct_s_fifo": fifo_m.average_jct(),
        "jct_vs_fifo": main.jct_ratio,
        "fifo_pending_growth": main.fifo_pending_growth(),
        "jct_vs_fifo_high_load": high.jct_ratio,
        "fifo_pending_growth_high_load": high.fifo_pending_growth(),
        "allocation_percent_main": ours.mean_allocation(since=main.warm_until, until=main.arrivals_end) * 100,
        "allocation_percent_main_fifo": fifo.mean_allocation(since=main.warm_until, until=main.arrivals_end) * 100,
        "allocation_percent": sat.mean_allocation_while_queued(since=sat_from, until=sat_until) * 100,
        "allocation_percent_saturated": sat.mean_allocation_while_queued(
            min_queued_gpus=sat.healthy_gpus // 20, since=sat_from, until=sat_until) * 100,
        # SimResult.queued_time counts the whole run (the queue drains long after the arrivals end); the share is
        # of the measured window, so only the intervals that start inside it count.
        "saturated_share_of_window": sum(dt for start, dt, _, _, queued in sat.intervals
                                         if queued >= sat.healthy_gpus // 20 and sat_from <= start < sat_until)
        / max(1e-9, sat_until - sat_from),
    }
    for label, _, _ in BUCKETS:
        key = label.replace("-", "_")
        for q, name in ((0.5, "p50"), (0.99, "p99")):
            figures[f"wait_s_{name}_{key}"] = ours_m.wait_percentile_by_bucket(q).get(label, math.nan)
            figures[f"wait_s_{name}_{key}_fifo"] = fifo_m.wait_percentile_by_bucket(q).get(label, math.nan)
            figures[f"wait_s_{name}_{key}_saturated"] = sat_m.wait_percentile_by_bucket(q).get(label, math.nan)
        figures[f"jct_vs_fifo_{key}"] = (ours_m.jct_by_bucket().get(label, math.nan)
                                         / fifo_m.jct_by_bucket().get(label, math.nan))
    sat_waits = sat_m.waits_by_bucket()
    figures["wait_s_max_513_1024_saturated"] = max(sat_waits.get("513-1024", [math.nan]))
    figures.update({
        "preemptions": float(ours.preemptions()),
        "preemptions_saturated": float(sat.preemptions()),
        "preempted_jobs_share_saturated": sum(1 for r in sat_m.jobs.values() if r.preemptions)
        / max(1, len(sat_m.jobs)),
        "max_preemptions_per_job_saturated": float(max((r.preemptions for r in sat.jobs.values()), default=0)),
        "reservations_held_per_cycle": statistics.mean(c.reservations for c in ours.cycles),
        "reservations_held_per_cycle_saturated": statistics.mean(c.reservations for c in sat.cycles),
        "failed_time_limit": float(len(ours.failed()) + len(sat.failed())),
        "failed_time_limit_fifo": float(len(fifo.failed())),
        "never_started": float(len(ours.never_started()) + len(sat.never_started())),
        "trace_jobs": float(size.trace_jobs),
        "measured_jobs": float(len(ours_m.jobs)),
        "trace_span_h": (main.arrivals_end - main.trace[0].submit) / 3600,
        "saturation_trace_jobs": float(size.sat_jobs),
        "saturation_span_h": (sat_until - sat_trace[0].submit) / 3600,
        "fleet_nodes": float(size.nodes),
        "fleet_gpus": float(size.nodes * GPUS_PER_NODE),
        "offered_load": LOAD,
        "offered_load_high": HIGH_LOAD,
        "offered_load_saturated": SAT_LOAD,
        "cycles": float(len(ours.cycles)),
        "cycles_fifo": float(len(fifo.cycles)),
        "cycles_saturated": float(len(sat.cycles)),
        "sim_s": main.ours_s,
        "sim_s_fifo": main.fifo_s,
        "sim_s_high_load": high.ours_s + high.fifo_s,
        "sim_s_saturated": sat_s,
    })
    figures.update(etcd)
    figures["commits_on_node_copies"] = float(capture.moved)
    figures["commit_vs_etcd_txn"] = etcd["commit_per_s"] / etcd["etcd_txn_per_s"]
    # What the store-side GPU guard costs etcd itself, and the commit path against that same transaction.
    figures["holdings_txn_vs_etcd_txn"] = etcd["etcd_txn_with_holdings_per_s"] / etcd["etcd_txn_per_s"]
    figures["commit_vs_etcd_txn_with_holdings"] = etcd["commit_per_s"] / etcd["etcd_txn_with_holdings_per_s"]
    figures["commit_vs_etcd_txn_with_encode"] = etcd["commit_per_s"] / etcd["etcd_txn_with_encode_per_s"]
    figures["wall_s"] = time.perf_counter() - t_start
    _print(figures)
    return figures


def _mean_pending(result: SimResult, since: float, until: float) -> float:
    values = [c.pending for c in result.cycles if since <= c.at < until]
    return statistics.mean(values) if values else 0.0


def _print(f: dict[str, float]) -> None:
    print(f"\nscheduler benchmark: {int(f['fleet_nodes']):,} nodes x {GPUS_PER_NODE} GPUs (3 models, 2 vendors, "
          f"leaf/spine/zone); comparison trace of {int(f['trace_jobs']):,} jobs over {f['trace_span_h']:.1f} h "
          f"at load {LOAD:g} (and {HIGH_LOAD:g}), cycle {CYCLE_S:g}s, {int(f['measured_jobs']):,} jobs measured "
          "after warm-up")
    rows = [
        ("decisions_per_s", "gang decisions / s of place() time (comparison run)"),
        ("decisions_per_s_saturated", "  saturation run"),
        ("decisions_per_s_backlog", f"  one session over a {int(f['backlog_jobs']):,}-job backlog, empty fleet"),
        ("decisions_per_s_excluding_index", "  decisions / s of per-job time only"),
        ("index_build_ms", "per cycle: place() time outside the per-job timings"),
        ("index_full_build_ms", "  a full index build from the busiest snapshot (not kept)"),
        ("place_call_ms_mean", "mean place() call"),
        ("p99_decision_ms_128node", f"p99, 128-node spine/zone gang, {int(f['samples_128node'])} samples"),
        ("p99_decision_ms_128node_main", f"  comparison run ({int(f['samples_128node_main'])})"),
        ("p99_decision_ms_128node_saturated", f"  saturation run ({int(f['samples_128node_saturated'])})"),
        ("p99_decision_ms_128node_burst", f"  burst on the busiest snapshot ({int(f['samples_128node_burst'])})"),
        ("commit_vs_etcd_txn", "Repository.commit_placement / raw etcd txn rate (job + allocation only)"),
        ("commit_vs_etcd_txn_with_holdings", "  commits / the same transaction raw (holdings included)"),
        ("holdings_txn_vs_etcd_txn", "  raw txn with holdings / raw txn without: the GPU guard's etcd cost"),
        ("etcd_txn_with_holdings_per_s", "  raw txns / s with one holdings compare and write per node"),
        ("commit_per_s", "  commits / s (64 in flight)"),
        ("commit_tls_vs_plaintext", "commits / s to etcd with TLS + auth / to plaintext etcd (same decisions)"),
        ("commit_per_s_tls_etcd", "  commits / s, etcd with TLS, client certificates and auth on"),
        ("commit_per_s_plaintext_etcd", "  commits / s, plaintext etcd"),
        ("etcd_txn_per_s", "  raw txns / s (64 in flight, records encoded beforehand)"),
        ("etcd_txn_with_encode_per_s", "  raw txns / s with the JSON encoding inside"),
        ("commit_vs_etcd_txn_with_encode", "  commits / raw txns with encoding"),
        ("jct_vs_fifo", f"average JCT, ours / type-unaware gang FIFO, load {LOAD:g}"),
        ("jct_s", "  ours, s"),
        ("jct_s_fifo", "  FIFO, s"),
        ("fifo_pending_growth", "  FIFO queue, last third / first third (bounded: ~1)"),
        ("allocation_percent_main", "  GPUs held, ours, %"),
        ("allocation_percent_main_fifo", "  GPUs held, FIFO, %"),
        ("jct_vs_fifo_high_load", f"  the same at load {HIGH_LOAD:g}"),
        ("fifo_pending_growth_high_load", "  FIFO queue growth there"),
        ("allocation_percent", "saturation run: GPUs held while a job was blocked, %"),
        ("allocation_percent_saturated", "  while >= 5% of the fleet's GPUs were queued, %"),
        ("wait_s_p99_513_1024_saturated", "  p99 wait of 513-1024 GPU jobs, s"),
        ("wait_s_p99_2_8_saturated", "  p99 wait of 2-8 GPU jobs, s"),
        ("max_preemptions_per_job_saturated", "  most preemptions of one job"),
        ("preemptions_saturated", "  preemptions"),
        ("mean_tiers_over_optimal", "multi-node gangs: tiers above the empty-fleet optimum"),
        ("mean_tiers_over_optimal_fifo", "  FIFO"),
        ("wait_s_p99_513_1024", "p99 wait of 513-1024 GPU jobs, comparison run, s"),
        ("wait_s_p99_513_1024_fifo", "  FIFO, s"),
        ("preemptions", "preemptions, comparison run"),
    ]
    print(f"  {'figure':<34} {'value':>12}  {'target':>9}  {'':4} what")
    for key, what in rows:
        value = f[key]
        target = TARGETS.get(key)
        verdict, goal = "", ""
        if target is not None:
            op, bound = target
            goal = f"{op} {bound:.3g}"
            verdict = "ok" if (value >= bound if op == ">=" else value <= bound) else "MISS"
        print(f"  {key:<34} {value:>12.4g}  {goal:>9}  {verdict:4} {what}")
    waits = "  ".join(f"{label}: {f['wait_s_p50_' + label.replace('-', '_')]:.0f}/"
                      f"{f['wait_s_p50_' + label.replace('-', '_') + '_fifo']:.0f}" for label, _, _ in BUCKETS)
    print(f"  median wait by size (GPUs), ours/FIFO, s:  {waits}")
    print(f"  saturation run: {int(f['saturation_trace_jobs']):,} jobs over {f['saturation_span_h']:.1f} h at load "
          f"{f['offered_load_saturated']:g}; measured from 40% of the arrival span (the fleet fills up first)")
