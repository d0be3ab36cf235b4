"""Bounded control-plane state (issue 14): the history store at 1,000,000 jobs, and two real scheduler leaders,
twins but for their history, compared. Everything below runs in one `run`, sizes from `Config`.

**The stores.** A real PostgreSQL (started here, initdb on disk) and a real SQLite file, through `HistoryStore`
itself, each filled to `jobs` finished jobs (bench/_history_fill.py: each built as the archiver writes it, a
job record of the size the scheduler encodes, spec, two attempts, labels, two usage records; teams, users,
queues, states, names and labels spread so that every filter selects a slice). Archiving 1,000,000 jobs one
batch at a time takes this 2-core machine about 7 minutes into PostgreSQL and 11 into SQLite (measured: 3,200
and 2,000 jobs/s near 1,000,000 rows, plus building the jobs), so the rows below the last `slice` are
bulk-loaded (indexes dropped, rows appended with COPY or executemany, indexes
built again from schema.py), and the last `slice` jobs go through `HistoryStore.archive` as the leader's
archiver writes them (batches of `batch`, one transaction each, idempotent upserts) into the store already
that full. PostgreSQL's last `push` rows are the leader's, below: it gets `jobs - slice - push` bulk rows.

- `archive_per_s_postgres`, `archive_per_s_sqlite`: jobs per second inside the store's `archive` calls over
  the slice (building the jobs is not the store's cost).

Then, with every store at `jobs` rows and after ANALYZE (the planner statistics a store filled over weeks
has), `queries` filtered pages of 50, newest first, each a different filter drawn from what users ask (a
team; a team and a state; a user; a label; a name prefix; a finished-time window; a queue and state; the next
page of one of these), timed one at a time:

- `list_p95_ms_postgres`, `list_p95_ms_sqlite` (target <= 50 ms at 1,000,000 jobs), `list_p50_ms_*`,
  `list_p95_vs_target_*` (p95 / 50 ms).
- `list_p95_ms_<store>_<kind>`: the same p95 over the pages of one kind of filter (`KINDS`: team, team_state,
  user, label, name_prefix, finished_window, queue_state, next_page; about an eighth of `queries` each, so a
  rougher figure), to say which kind a slow overall p95 comes from. A kind the draw did not pick has none.

**The leaders** (bench/_history_cycle.py, each `bench/_history_leader.py`: a `SchedulerApp` in a process of
its own, mTLS, the scheduler's gc tuning and INFO JSON logs, agents that accept every launch; each its own
etcd, TLS with client certificates and auth on, auto-compaction as every etcd here runs). Both get the same
fleet (`nodes` 8-GPU nodes of the simulator's mixed fleet, registered in etcd) and the same active load,
submitted through JobService: running gangs of 1, 1, 2 and 4 nodes until the fleet is full, and `pending`
one-node jobs waiting behind them; `reconcile_interval_s` 0.1. The fleet is small on purpose: a cycle's cost
grows with nodes and active jobs (about 17 ms at 512 nodes here), the loop runs one after every change, and
during the push that leaves the leader 25 jobs/s (100,000 in over an hour) against 60-75 at 64 nodes;
and the smaller a cycle, the larger a share of it any cost that grew with history would be.

Leader "none" archives into an empty PostgreSQL database and never finishes a job. Leader "history" archives
into the PostgreSQL database filled above, and then `push` jobs go through its real path: SubmitJob, CancelJob
while pending (a pending job is cancelled at once, terminal), its archiver writes each to the history store and
marks it in etcd, and `job_ttl_s` (1 s) after it ended deletes it from etcd. At most `max_live` pushed jobs are
in etcd at once (the push follows the archiver's pace, as jobs that end well below the archiving rate would). So
after the push the "history" leader has archived `push` jobs through etcd and its history store holds `jobs`
rows (`jobs - push` of them written directly, above: bulk-loaded and the archived slice); nothing of that is in
its etcd any more.

Then `rounds` windows of `window_s` in which the cycles of both leaders' own reconcile loops are timed at once
(the loop's `cycle`, every cycle it ran), before the push and after:

- `cycle_ms_vs_history` (target <= 1.1): the median over the windows of (the "history" leader's median cycle
  / the "none" leader's, same window), after the push; `cycle_ms_none`, `cycle_ms_history` (medians over all
  windows), `cycle_ms_p90_vs_history`; `cycle_ms_twins_before_push`: the same ratio before the push, when
  the two leaders are twins (the method's own noise).
- `leader_rss_mb_vs_history` (target <= 1.1): the RSS of the "history" leader's process (/proc VmRSS, the
  whole process: the interpreter, gRPC, the mirror, the history store's engine) / the "none" leader's, after
  the push; `leader_rss_mb_none`, `leader_rss_mb_history`, `leader_rss_twins_before_push`, and
  `leader_rss_mb_peak_during_push` (the "history" leader's largest RSS sampled during the push).
  `mirror_keys_none` and `mirror_keys_history`: the keys each leader's etcd mirror holds after the push.
- `leader_archive_per_s`: pushed jobs / seconds from the first submit until the last left etcd: the rate the
  leader's whole path sustained (submit, cancel, archive, mark, expire), which its archiver sets (a batch of
  200 a pass, a pass a second at most).

etcd of the "history" leader after the push (its maintenance Status RPC, `etcdctl endpoint status -w json`):

- `etcd_db_mb_after_100k_jobs` (target <= 64 MB): etcd's `dbSize` after the push, once compacted to the
  current revision and defragmented as docs/operations.md ("etcd space") has an operator do; `_in_use_` its
  `dbSizeInUse`; `etcd_db_mb_after_100k_jobs_undefragmented` and `etcd_db_in_use_mb_after_100k_jobs_
  undefragmented`: the same before that (what auto-compaction's 5-minute window left), `etcd_db_in_use_mb_
  after_100k_jobs_compacted`: in use after the compaction, before the defragmentation; `etcd_db_mb_before_
  push`: the fleet and the active load alone. The figures are named for 100,000 jobs; `pushed_jobs` says how
  many went through (TINY: a few hundred).
- `etcd_job_keys_after_push` (the active load's jobs only), `etcd_audit_entries_after_push`,
  `etcd_audit_mb_after_push` (keys and values): the audit entries (one per submit and per cancel) still in
  etcd, which is the leader's mover's backlog (audit_archive.py moves them to the history store within
  seconds); `history_audit_entries_after_push`: those it moved; `etcd_db_mb_after_100k_jobs_without_audit`:
  the same member with that backlog deleted too, compacted and defragmented again.

**Against the scheduler's completion rate.** `completion_per_s`: the rate jobs arrive, and so finish, in
bench/scheduler.py's full-size main run (its trace for 10,000 nodes at LOAD 0.5, which its simulation keeps
up with), from that trace, made here exactly as it makes it (no simulation; the fleet's saturated ceiling is
about twice this). `archive_vs_completion` = `leader_archive_per_s` / `completion_per_s` (target >= 2): the
slowest of the archive rates here (each store's own rate is far higher).
"""

from __future__ import annotations

import asyncio
import functools
import random
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

from bench import scheduler as scheduler_bench
from bench._history_cycle import LeaderLoad, compare
from bench._history_fill import QUEUES, T0, TEAMS, archive_slice, bulk_load
from trainyard_core.testing import postgres
from trainyard_scheduler.history.store import HistoryStore, JobFilter
from trainyard_scheduler.sim import FleetShape, synthetic_trace


@dataclass(frozen=True)
class Config:
    jobs: int = 1_000_000   # rows in each history store when queried
    slice: int = 100_000    # of them, written through HistoryStore.archive (timed); the rest bulk-loaded
    batch: int = 200
    queries: int = 200
    page: int = 50
    seed: int = 7
    nodes: int = 64         # the leaders' fleet (see the docstring: why not more)
    pending: int = 32       # jobs waiting behind the running gangs
    push: int = 100_000     # jobs through the "history" leader's real path
    concurrency: int = 16
    max_live: int = 1_000
    rounds: int = 10
    window_s: float = 3.0

    def leader_load(self) -> LeaderLoad:
        return LeaderLoad(nodes=self.nodes, pending=self.pending, push=self.push, concurrency=self.concurrency,
                          max_live=self.max_live, rounds=self.rounds, window_s=self.window_s, interval_s=0.1,
                          teams=tuple(TEAMS))


TINY = Config(jobs=2_000, slice=1_000, batch=200, queries=20, nodes=16, pending=8, push=300, rounds=2, window_s=1.0)


# The filter kinds `_filters` draws, in the order it numbers them; each names its `list_p95_ms_<store>_<kind>`.
KINDS = ("team", "team_state", "user", "label", "name_prefix", "finished_window", "queue_state", "next_page")


def _filters(config: Config, rng: random.Random) -> list[tuple[str, Callable[[HistoryStore], Awaitable[object]]]]:
    """`config.queries` pages to ask for, each with the name of its kind (one of KINDS)."""
    span = config.jobs * 0.5
    out: list[tuple[str, Callable[[HistoryStore], Awaitable[object]]]] = []
    for _ in range(config.queries):
        team = TEAMS[rng.randrange(len(TEAMS))]
        kind = rng.randrange(len(KINDS))
        start = T0 + rng.uniform(0, span)
        flt = [JobFilter(team=team),
               JobFilter(team=team, states=frozenset({"failed"})),
               JobFilter(user=f"u{rng.randrange(500)}"),
               JobFilter(team=team, labels={"project": f"p{rng.randrange(200)}"}),
               JobFilter(team=team, name_prefix=rng.choice(["llama", "bert-1", "sweep-99"])),
               JobFilter(team=team, finished_after=start, finished_before=start + 86400),
               JobFilter(queue=rng.choice(QUEUES), states=frozenset({"cancelled"})),
               JobFilter(team=team)][kind]
        before = f"job-{rng.randrange(config.jobs):012d}" if kind == 7 else ""
        out.append((KINDS[kind], functools.partial(_page, flt=flt, limit=config.page, before=before)))
    return out


def _page(store: HistoryStore, *, flt: JobFilter, limit: int, before: str) -> Awaitable[object]:
    return store.list(flt, limit=limit, before=before)


async def _fill(url: str, bulk: int, config: Config) -> float:
    """Jobs 0 .. bulk-1 bulk-loaded, then the next `slice` through the archive path; returns the slice's jobs
    archived per second."""
    store = await HistoryStore.open(url)
    try:
        await bulk_load(store, bulk, config.seed)
        return await archive_slice(store, bulk, config.slice, config.batch, config.seed)
    finally:
        await store.close()


async def _query(url: str, config: Config) -> list[tuple[str, float]]:
    """Each of `_filters`' pages timed once, in milliseconds, with its kind."""
    store = await HistoryStore.open(url)
    try:
        rows = await store.count()
        assert rows == config.jobs, f"{rows} jobs in the store, not {config.jobs}"
        # Planner statistics, as autovacuum (PostgreSQL) or a periodic ANALYZE (SQLite) keep them on a store that
        # filled over weeks rather than in one load.
        async with store.engine.begin() as conn:
            await conn.execute(sa.text("ANALYZE"))
        times = []
        for kind, query in _filters(config, random.Random(config.seed + 1)):
            t = time.perf_counter()
            await query(store)
            times.append((kind, (time.perf_counter() - t) * 1e3))
        return times
    finally:
        await store.close()


def completion_per_s() -> float:
    """Jobs per second arriving, and so finishing, in bench/scheduler.py's full-size main run: its trace."""
    size = scheduler_bench.Config()
    trace = synthetic_trace(size.trace_jobs, scheduler_bench.SEED, load=scheduler_bench.LOAD,
                            shape=FleetShape(nodes=size.nodes, gpus_per_node=scheduler_bench.GPUS_PER_NODE),
                            median_runtime_s=scheduler_bench.MEDIAN_RUNTIME_S)
    return (len(trace) - 1) / (trace[-1].submit - trace[0].submit)


def _p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20)[-1] if len(values) >= 2 else values[0]


def run(config: Config = Config()) -> dict[str, float]:
    assert config.push > 0 and config.slice + config.push <= config.jobs, "the store's rows include both"
    figures: dict[str, float] = {"jobs": float(config.jobs)}
    # On disk, as a database is (not the tmpfs the other benchmarks use for their scratch files).
    with tempfile.TemporaryDirectory(prefix="bench-history-") as tmp:
        base = Path(tmp)
        base.chmod(0o755)  # the server runs as the postgres account when this runs as root
        server = postgres.start(workdir=base)
        try:
            urls = {"postgres": server.url(), "sqlite": f"sqlite+aiosqlite:///{base / 'history.db'}"}
            # PostgreSQL's last `push` rows come from the leader, through the real path.
            bulk = {"postgres": config.jobs - config.slice - config.push, "sqlite": config.jobs - config.slice}
            rates = {name: asyncio.run(_fill(url, bulk[name], config)) for name, url in urls.items()}
            leaders = asyncio.run(compare(config.leader_load(), base, {
                "none": server.create_database("history_none"), "history": urls["postgres"]}))
            for name, url in urls.items():
                timed = asyncio.run(_query(url, config))
                times = [ms for _, ms in timed]
                figures[f"archive_per_s_{name}"] = rates[name]
                figures[f"list_p50_ms_{name}"] = statistics.median(times)
                figures[f"list_p95_ms_{name}"] = _p95(times)
                figures[f"list_p95_vs_target_{name}"] = _p95(times) / 50.0
                for kind in KINDS:  # a kind the draw never picked (a small run) has no figure
                    if of_kind := [ms for k, ms in timed if k == kind]:
                        figures[f"list_p95_ms_{name}_{kind}"] = _p95(of_kind)
        finally:
            postgres.stop_and_clean(server)
    figures.update(leaders)
    figures["completion_per_s"] = completion_per_s()
    figures["archive_vs_completion"] = leaders["leader_archive_per_s"] / figures["completion_per_s"]
    return figures
