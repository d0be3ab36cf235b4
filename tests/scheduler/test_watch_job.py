"""WatchJob: the job now, then each change until it ends, also when etcd compacted the revisions after the
one the watch started from (a job unchanged for longer than the auto-compaction window)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2
from trainyard_core.clock import SystemClock
from trainyard_core.store.memory import MemoryStore
from trainyard_scheduler.domain.models import JobState
from trainyard_scheduler.grpc.servicer import JobServicer
from trainyard_scheduler.state.keys import Keys
from trainyard_scheduler.state.repository import Repository

from .builders import make_job


async def _change(repo: Repository, job_id: str, **fields: object) -> None:
    found = await repo.get_job(job_id)
    assert found is not None
    await repo.update_job(replace(found[0], **fields), found[1])  # type: ignore[arg-type]


async def test_watch_survives_compaction_and_ends_with_the_job() -> None:
    store = MemoryStore()
    repo = Repository(store, Keys("/t"))
    job = make_job("job-watched")
    await repo.create_job(job)
    await repo.create_job(make_job("job-other"))
    # Other keys move etcd's revision on and a compaction drops the revisions since the job last changed:
    # the watch the stream opens from there is refused as compacted.
    await _change(repo, "job-other", message="x")
    store.compact()
    servicer = JobServicer(repo, SystemClock(), asyncio.Event())
    stream = servicer.WatchJob(scheduler_pb2.WatchJobRequest(job_id=job.id), None)  # type: ignore[arg-type]
    seen: asyncio.Queue[types_pb2.Job] = asyncio.Queue()

    async def consume() -> None:
        async for reply in stream:
            await seen.put(reply.job)

    task = asyncio.create_task(consume())
    try:
        assert (await asyncio.wait_for(seen.get(), 5)).state == types_pb2.JOB_STATE_PENDING
        await asyncio.sleep(0.05)  # the stream has met the compaction and watches again
        await store.put("/t/jobs/job-other-2", b"{}")  # an event that is not the job shows nothing
        await _change(repo, job.id, state=JobState.RUNNING, message="running")
        got = await asyncio.wait_for(seen.get(), 5)
        assert (got.state, got.message) == (types_pb2.JOB_STATE_RUNNING, "running"), "nothing shown twice"
        await _change(repo, job.id, state=JobState.SUCCEEDED, message="done", finished_at=1.0)
        assert (await asyncio.wait_for(seen.get(), 5)).state == types_pb2.JOB_STATE_SUCCEEDED
        await asyncio.wait_for(task, 5)  # the stream ends with the job
    finally:
        task.cancel()
    assert task.exception() is None
