"""The history store at size (issue 14): archiving throughput and filtered pages over many finished jobs, on
a real PostgreSQL (started here, initdb on disk) and a real SQLite file, through `HistoryStore` itself.

`jobs` finished jobs are archived in batches of `batch` (the leader's archiver batch), as the archiver writes
them: a job record of the size the scheduler encodes (spec, two attempts), labels, two usage records
each; teams, users, queues, states, names and labels spread so that every filter selects a slice. The load
itself is the archive figure:

- `archive_per_s_postgres`, `archive_per_s_sqlite`: jobs archived per second over the whole load (one
  transaction per batch, idempotent upserts, as the archiver does). Target: at least twice the rate jobs
  finish at in the scheduler benchmark (not computed here: compare with its `jct` trace).

Then, after ANALYZE (the planner statistics a store filled over weeks has), `queries` filtered pages of 50,
newest first, each a different filter drawn from what users ask (a team; a team and a state; a user; a
label; a name prefix; a finished-time window; a queue and state; the next page of one of these), timed one
at a time:

- `list_p95_ms_postgres`, `list_p95_ms_sqlite` (target ≤ 50 ms at 1,000,000 jobs), `list_p50_ms_*`.

Not measured here yet (issue 14's other figures): a reconcile cycle's time and the leader's memory with
1,000,000 jobs archived against none, and etcd's database size after 100,000 jobs have finished and expired.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path

import sqlalchemy as sa

from trainyard_core.testing import postgres
from trainyard_scheduler.archive import archived
from trainyard_scheduler.domain.jobs import end_attempt
from trainyard_scheduler.domain.models import Allocation, Job, JobSpec, JobState, NodeAssignment, Resources
from trainyard_scheduler.history.store import HistoryStore, JobFilter

TEAMS = [f"team-{i:02d}" for i in range(40)]
STATES = [JobState.SUCCEEDED, JobState.SUCCEEDED, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED]
QUEUES = ["default", "batch", "interactive", "research"]
T0 = 1_780_000_000.0


@dataclass(frozen=True)
class Config:
    jobs: int = 1_000_000
    batch: int = 200
    queries: int = 200
    page: int = 50
    seed: int = 7


TINY = Config(jobs=2_000, batch=200, queries=20)


def _job(i: int, rng: random.Random) -> Job:
    """The i-th finished job: submitted every 0.5 s on average, running minutes to hours."""
    submitted = T0 + i * 0.5
    team = TEAMS[rng.randrange(len(TEAMS))]
    spec = JobSpec(name=f"{rng.choice(['llama', 'mixtral', 'bert', 'vit', 'sweep'])}-{i % 997}",
                   command=("python", "-m", "train", "--config", "configs/run.yaml"),
                   resources=Resources(nodes=rng.choice([1, 1, 2, 8]), gpus_per_node=8, accelerator="H100"),
                   env={"WANDB_API_KEY": "x" * 32, "EPOCHS": "3"}, queue=QUEUES[rng.randrange(len(QUEUES))],
                   labels={"project": f"p{rng.randrange(200)}", "owner": f"u{rng.randrange(500)}"})
    state = STATES[rng.randrange(len(STATES))]
    job = Job(id=f"job-{i:012d}", spec=spec, state=state, team=team, user=f"u{rng.randrange(500)}",
              created_at=submitted, updated_at=submitted, queued_at=submitted, message="all 8 worker(s) exited 0")
    start = submitted + rng.uniform(1, 120)
    for attempt in (1, 2):  # the first ended in a restart, the second with the job
        alloc = Allocation(job_id=job.id, attempt=attempt, master_addr="n1", master_port=29500, created_at=start,
                           assignments=tuple(NodeAssignment(f"gpu-{rng.randrange(4096):04d}", r, tuple(range(8)),
                                                            tuple(range(8 * r, 8 * r + 8)), model="H100")
                                             for r in range(spec.resources.nodes)))
        start_next = start + rng.uniform(60, 7200)
        job = end_attempt(replace(job, attempt=attempt), alloc, start_next)
        start = start_next + 10
    return replace(job, finished_at=start, updated_at=start)


def _filters(config: Config, rng: random.Random) -> list[Callable[[HistoryStore], Awaitable[object]]]:
    span = config.jobs * 0.5
    out: list[Callable[[HistoryStore], Awaitable[object]]] = []
    for _ in range(config.queries):
        team = TEAMS[rng.randrange(len(TEAMS))]
        kind = rng.randrange(8)
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
        out.append(lambda store, flt=flt, before=before: store.list(flt, limit=config.page, before=before))
    return out


async def _measure(url: str, config: Config) -> tuple[float, list[float]]:
    store = await HistoryStore.open(url)
    try:
        rng = random.Random(config.seed)
        archive_s = 0.0  # in the store's archive calls only (making the jobs here is not the store's cost)
        for first in range(0, config.jobs, config.batch):
            batch = [archived(_job(i, rng)) for i in range(first, min(first + config.batch, config.jobs))]
            began = time.perf_counter()
            await store.archive(batch)
            archive_s += time.perf_counter() - began
        assert await store.count() == config.jobs
        # Planner statistics, as autovacuum (PostgreSQL) or a periodic ANALYZE (SQLite) keep them on a store that
        # filled over weeks rather than in one load.
        async with store.engine.begin() as conn:
            await conn.execute(sa.text("ANALYZE"))
        times = []
        for query in _filters(config, random.Random(config.seed + 1)):
            t = time.perf_counter()
            await query(store)
            times.append((time.perf_counter() - t) * 1e3)
        return config.jobs / archive_s, times
    finally:
        await store.close()


def _p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20)[-1] if len(values) >= 2 else values[0]


def run(config: Config = Config()) -> dict[str, float]:
    figures: dict[str, float] = {"jobs": float(config.jobs)}
    # On disk, as a database is (not the tmpfs the other benchmarks use for their scratch files).
    with tempfile.TemporaryDirectory(prefix="bench-history-") as tmp:
        base = Path(tmp)
        base.chmod(0o755)  # the server runs as the postgres account when this runs as root
        server = postgres.start(workdir=base)
        try:
            urls = {"postgres": server.url(), "sqlite": f"sqlite+aiosqlite:///{base / 'history.db'}"}
            for name, url in urls.items():
                per_s, times = asyncio.run(_measure(url, config))
                figures[f"archive_per_s_{name}"] = per_s
                figures[f"list_p50_ms_{name}"] = statistics.median(times)
                figures[f"list_p95_ms_{name}"] = _p95(times)
                figures[f"list_p95_vs_target_{name}"] = _p95(times) / 50.0
        finally:
            postgres.stop_and_clean(server)
    return figures
