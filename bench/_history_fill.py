"""bench/history's synthetic history: finished jobs as the archiver writes them, and two ways into a store.

- `archive_slice`: through `HistoryStore.archive`, as the leader's archiver writes (batches of `batch`, one
  transaction each, idempotent upserts), each job built as the scheduler builds it (`_job`: a `Job` with two
  attempts, encoded by `archived`). Timed in the store's calls only: this is the archive figure.
- `bulk_load`: what a restore from a dump does, to reach 1,000,000 rows in minutes rather than the better
  part of an hour on this 2-core machine: the store's secondary indexes dropped, the rows appended (COPY on
  PostgreSQL, executemany on SQLite, in large transactions), the indexes built again from schema.py's
  definitions (what the migrations create; a test keeps the two equal). Its rows have the same columns,
  labels, usage records and distributions as `_job`'s (drawn alike, not the same draws), and all share one
  job record's bytes (`record` is opaque to the store and no query reads into it).

Job i was submitted at T0 + i/2 s and its id is `job-<i, 12 digits>`, so ids, submission and finish times
grow with i, as in a store filled over time; teams, users, queues, states, names and labels are spread so
that every filter of bench/history selects a slice.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from trainyard_scheduler.archive import archived
from trainyard_scheduler.domain.jobs import end_attempt
from trainyard_scheduler.domain.models import Allocation, Job, JobSpec, JobState, NodeAssignment, Resources
from trainyard_scheduler.history import schema
from trainyard_scheduler.history.store import ArchivedJob, HistoryStore, UsageRecord

TEAMS = [f"team-{i:02d}" for i in range(40)]
STATES = [JobState.SUCCEEDED, JobState.SUCCEEDED, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED]
QUEUES = ["default", "batch", "interactive", "research"]
NAMES = ["llama", "mixtral", "bert", "vit", "sweep"]
NODE_COUNTS = [1, 1, 2, 8]
T0 = 1_780_000_000.0
CHUNK = 20_000  # rows per bulk transaction


def _job(i: int, rng: random.Random) -> Job:
    """The i-th finished job: submitted every 0.5 s on average, running minutes to hours."""
    submitted = T0 + i * 0.5
    team = TEAMS[rng.randrange(len(TEAMS))]
    spec = JobSpec(name=f"{rng.choice(NAMES)}-{i % 997}",
                   command=("python", "-m", "train", "--config", "configs/run.yaml"),
                   resources=Resources(nodes=rng.choice(NODE_COUNTS), gpus_per_node=8, accelerator="H100"),
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


def _fast(i: int, rng: random.Random, record: bytes) -> ArchivedJob:
    """The i-th finished job as `archived(_job(i, ...))` has it, drawn alike, without building the Job."""
    submitted = T0 + i * 0.5
    team = TEAMS[rng.randrange(len(TEAMS))]
    name = f"{rng.choice(NAMES)}-{i % 997}"
    nodes = rng.choice(NODE_COUNTS)
    queue = QUEUES[rng.randrange(len(QUEUES))]
    labels = {"project": f"p{rng.randrange(200)}", "owner": f"u{rng.randrange(500)}"}
    state = STATES[rng.randrange(len(STATES))].value
    user = f"u{rng.randrange(500)}"
    job_id = f"job-{i:012d}"
    start = submitted + rng.uniform(1, 120)
    usage = []
    for attempt in (1, 2):
        end = start + rng.uniform(60, 7200)
        usage.append(UsageRecord(job_id=job_id, attempt=attempt, team=team, user=user, project=labels["project"],
                                 queue=queue, accelerator_model="H100", gpus=8 * nodes, cpus=0, nodes=nodes,
                                 started_at=start, ended_at=end))
        start = end + 10
    return ArchivedJob(job_id=job_id, team=team, user=user, name=name, queue=queue, state=state, labels=labels,
                       submitted_at=submitted, finished_at=start, record=record, usage=tuple(usage))


async def archive_slice(store: HistoryStore, first: int, count: int, batch: int, seed: int) -> float:
    """Jobs first .. first+count-1 through `store.archive`; returns jobs per second inside those calls."""
    rng = random.Random(seed + first)
    took = 0.0
    for lo in range(first, first + count, batch):
        jobs = [archived(_job(i, rng)) for i in range(lo, min(lo + batch, first + count))]
        began = time.perf_counter()
        await store.archive(jobs)
        took += time.perf_counter() - began
    return count / took


_TABLES = (schema.jobs, schema.job_labels, schema.usage_records)


def _rows(jobs: Sequence[ArchivedJob], archived_at: float) -> dict[str, list[tuple[Any, ...]]]:
    """Each table's rows, columns in the table's order."""
    return {
        "jobs": [(j.job_id, j.team, j.user, j.name, j.queue, j.state, j.submitted_at, j.finished_at, archived_at,
                  j.record) for j in jobs],
        "job_labels": [(j.job_id, k, v) for j in jobs for k, v in sorted(j.labels.items())],
        "usage_records": [(u.job_id, u.attempt, u.team, u.user, u.project, u.queue, u.accelerator_model, u.gpus,
                           u.cpus, u.nodes, u.started_at, u.ended_at) for j in jobs for u in j.usage],
    }


def _chunks(count: int, seed: int, record: bytes) -> Iterator[list[ArchivedJob]]:
    rng = random.Random(seed)
    for lo in range(0, count, CHUNK):
        yield [_fast(i, rng, record) for i in range(lo, min(lo + CHUNK, count))]


async def bulk_load(store: HistoryStore, count: int, seed: int) -> None:
    """Jobs 0 .. count-1 into an empty store, the bulk way (see the module docstring)."""
    if count <= 0:
        return
    record = archived(_job(0, random.Random(seed))).record
    postgres = store.engine.dialect.name == "postgresql"
    indexes = [index for table in _TABLES for index in table.indexes]
    async with store.engine.begin() as conn:
        for index in indexes:
            await conn.run_sync(index.drop)
    for jobs in _chunks(count, seed, record):
        rows = _rows(jobs, time.time())
        async with store.engine.begin() as conn:
            if postgres:
                raw = (await conn.get_raw_connection()).driver_connection
                assert raw is not None
                for table in _TABLES:
                    await raw.copy_records_to_table(table.name, records=rows[table.name],
                                                    columns=[c.name for c in table.columns])
            else:
                for table in _TABLES:
                    names = [c.name for c in table.columns]
                    await conn.execute(table.insert(), [dict(zip(names, r, strict=True)) for r in rows[table.name]])
    async with store.engine.begin() as conn:
        for index in indexes:
            await conn.run_sync(index.create)
    assert await store.count() == count
