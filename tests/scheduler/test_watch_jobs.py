"""JobWatchService.WatchJobs, the stream the gateway's read view is fed by: a snapshot of every live job at one
revision (in chunks), then each change, each job as GetJob answers it; deletes of the jobs that left etcd and
the history store's bound; progress while nothing changes; served by the leader and by a standby, over mTLS,
to the gateway only.

The first tests run real schedulers (mTLS, a history store) on the session's etcd and call them as the
gateway; the last ones run the servicer over the in-memory store's mirror, for what needs records written by
hand (a running gang's exits, chunk boundaries).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_core.rpc.server import secure_channel
from trainyard_core.security import identity, pki
from trainyard_core.security.tls import ClientTls
from trainyard_core.store.memory import MemoryStore
from trainyard_core.store.mirror import PrefixMirror
from trainyard_core.testing.wait import eventually, truthy
from trainyard_scheduler.app import SchedulerApp
from trainyard_scheduler.domain.models import WorkerExit
from trainyard_scheduler.grpc.job_watch_servicer import JobWatchServicer
from trainyard_scheduler.settings import SchedulerSettings
from trainyard_scheduler.state.codec import encode_allocation, encode_job
from trainyard_scheduler.state.keys import Keys

from .builders import make_job, running

SPEC = types_pb2.JobSpec(name="train", command=["true"], resources=types_pb2.Resources(nodes=1, gpus_per_node=1))


class Stream:
    """A WatchJobs stream, read message by message."""

    def __init__(self, messages: AsyncIterator[scheduler_pb2.WatchJobsResponse]) -> None:
        self._messages = aiter(messages)

    async def next(self, timeout: float = 10.0) -> scheduler_pb2.WatchJobsResponse:
        return await asyncio.wait_for(anext(self._messages), timeout)

    async def snapshot(self) -> tuple[int, dict[str, scheduler_pb2.WatchedJob], scheduler_pb2.HistoryBound]:
        first = await self.next()
        assert first.reset, "a stream begins with a snapshot"
        jobs = {w.job.id: w for w in first.jobs}
        last = first
        while not last.synced:
            last = await self.next()
            assert not last.reset and last.revision == first.revision, "one snapshot, at one revision"
            jobs.update({w.job.id: w for w in last.jobs})
        return first.revision, jobs, first.history

    async def until(self, test: Any, timeout: float = 20.0) -> scheduler_pb2.WatchJobsResponse:
        async def find() -> scheduler_pb2.WatchJobsResponse:
            while True:
                message = await self.next(timeout)
                if test(message):
                    return message
        return await asyncio.wait_for(find(), timeout)


@contextlib.asynccontextmanager
async def scheduler(etcd_settings: dict[str, str], prefix: str, tmp_path: Path, pki_dir: Path,
                    **more: Any) -> AsyncIterator[SchedulerApp]:
    settings = SchedulerSettings(**etcd_settings, etcd_prefix=prefix.rstrip("/"), listen_port=0, leader_ttl_s=2,
                                 reconcile_interval_s=0.2, history_url=f"sqlite+aiosqlite:///{tmp_path / 'h.db'}",
                                 **pki.files_for(pki_dir, identity.SCHEDULER).settings(), **more)
    app = SchedulerApp(settings)
    await app.start()
    try:
        yield app
    finally:
        await app.stop()


@contextlib.asynccontextmanager
async def as_principal(app: SchedulerApp, pki_dir: Path,
                       who: Any = identity.GATEWAY) -> AsyncIterator[grpc.aio.Channel]:
    channel = secure_channel(f"127.0.0.1:{app.grpc_port}", ClientTls(pki.files_for(pki_dir, who)), identity.SCHEDULER)
    try:
        yield channel
    finally:
        await channel.close()


async def test_a_snapshot_then_each_change_as_getjob_answers_it(etcd_settings: dict[str, str], key_prefix: str,
                                                                tmp_path: Path, pki_dir: Path) -> None:
    async with scheduler(etcd_settings, key_prefix, tmp_path, pki_dir, job_ttl_s=0.0) as app, \
            as_principal(app, pki_dir) as channel:
        jobs = scheduler_pb2_grpc.JobServiceStub(channel)
        submitted = [await jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=SPEC, team=team, user="u"))
                     for team in ("vision", "nlp", "vision")]
        assert all(s.revision > 0 for s in submitted)
        gone = submitted[0].job.id
        cancelled = await jobs.CancelJob(scheduler_pb2.CancelJobRequest(job_id=gone, team="vision"))
        assert cancelled.revision > submitted[-1].revision

        async def archived() -> bool:  # the cancelled job is in the history store and has left etcd
            return await app.store.get(app.keys.job(gone)) is None
        await eventually(archived, timeout=30, what="the cancelled job to leave etcd")

        stream = Stream(scheduler_pb2_grpc.JobWatchServiceStub(channel).WatchJobs(scheduler_pb2.WatchJobsRequest()))
        revision, snapshot, history = await stream.snapshot()
        assert set(snapshot) == {s.job.id for s in submitted[1:]}
        assert (history.enabled, history.known, history.max_job_id) == (True, True, gone)
        for job_id, watched in snapshot.items():
            assert watched.job == (await jobs.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id))).job
        assert revision >= cancelled.revision

        # Applied in order, the messages give a copy that, once at a write's revision, shows that write.
        copy = dict(snapshot)

        async def reach(revision: int) -> None:
            while True:
                message = await stream.next()
                assert message.synced and not message.reset
                copy.update({w.job.id: w for w in message.jobs})
                for job_id in message.deleted:
                    copy.pop(job_id, None)
                if message.revision >= revision:
                    return

        newer = await jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=SPEC, team="nlp", user="u"))
        await reach(newer.revision)
        assert copy[newer.job.id].job.state == types_pb2.JOB_STATE_PENDING
        stop = await jobs.CancelJob(scheduler_pb2.CancelJobRequest(job_id=newer.job.id))
        await reach(stop.revision)
        assert newer.job.id not in copy or copy[newer.job.id].job.state == types_pb2.JOB_STATE_CANCELLED
        left = await stream.until(lambda m: newer.job.id in m.deleted, timeout=30)  # archived, then expired
        assert left.revision > stop.revision
        got = await jobs.GetJob(scheduler_pb2.GetJobRequest(job_id=newer.job.id))  # from the history now
        assert got.job.state == types_pb2.JOB_STATE_CANCELLED


async def test_only_the_gateway_may_watch_every_teams_jobs(etcd_settings: dict[str, str], key_prefix: str,
                                                           tmp_path: Path, pki_dir: Path) -> None:
    async with scheduler(etcd_settings, key_prefix, tmp_path, pki_dir, tool_teams=["ops:vision"]) as app, \
            as_principal(app, pki_dir, identity.tool("ops")) as channel:
        call = scheduler_pb2_grpc.JobWatchServiceStub(channel).WatchJobs(scheduler_pb2.WatchJobsRequest())
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await asyncio.wait_for(anext(aiter(call)), 10)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_a_standby_serves_the_same_snapshot_as_the_leader(etcd_settings: dict[str, str], key_prefix: str,
                                                                tmp_path: Path, pki_dir: Path) -> None:
    async with scheduler(etcd_settings, key_prefix, tmp_path, pki_dir) as leader, \
            scheduler(etcd_settings, key_prefix, tmp_path, pki_dir) as standby, \
            as_principal(leader, pki_dir) as to_leader, as_principal(standby, pki_dir) as to_standby:
        await eventually(lambda: truthy(leader.leadership.epoch > 0), what="the first replica to lead")
        assert standby.leadership.epoch == 0
        jobs = scheduler_pb2_grpc.JobServiceStub(to_standby)  # a standby takes submits too
        last = None
        for _ in range(3):
            last = await jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=SPEC, team="vision", user="u"))
        assert last is not None

        async def snapshot(channel: grpc.aio.Channel) -> dict[str, str]:
            stream = Stream(scheduler_pb2_grpc.JobWatchServiceStub(channel).WatchJobs(scheduler_pb2.WatchJobsRequest()))
            _, jobs, _ = await stream.snapshot()
            while last.job.id not in jobs:  # the replica's mirror has not seen the last submit yet
                message = await stream.next()
                jobs.update({w.job.id: w for w in message.jobs})
            return {job_id: w.job.id for job_id, w in jobs.items()}
        assert await snapshot(to_standby) == await snapshot(to_leader)


# --- the servicer over the in-memory store's mirror ---------------------------------------------------------

@contextlib.asynccontextmanager
async def mirrored(store: MemoryStore, keys: Keys) -> AsyncIterator[PrefixMirror]:
    mirror = PrefixMirror(store, keys.prefix + "/", include=keys.mirrored)
    await mirror.start()
    try:
        yield mirror
    finally:
        await mirror.stop()


async def test_a_snapshot_in_chunks_a_running_gangs_exits_progress_and_deletes() -> None:
    store, keys = MemoryStore(), Keys("/t")
    for i in range(4):
        await store.put(keys.job(f"job-{i}"), encode_job(make_job(f"job-{i}")))
    job, alloc = running(make_job("job-run", gpus=2), [("n-1", [0, 1])])
    alloc = replace(alloc, exits=(WorkerExit(rank=1, node_id="n-1", exit_code=3, signal=0, at=1.0),))
    await store.put(keys.job(job.id), encode_job(job))
    await store.put(keys.allocation(job.id), encode_allocation(alloc))
    async with mirrored(store, keys) as mirror:
        servicer = JobWatchServicer(mirror, keys, None, chunk_jobs=2, progress_s=0.05)
        stream = Stream(servicer.WatchJobs(scheduler_pb2.WatchJobsRequest(), None))  # type: ignore[arg-type]
        parts = [await stream.next()]
        while not parts[-1].synced:
            parts.append(await stream.next())
        assert [len(p.jobs) for p in parts] == [2, 2, 1] and [p.reset for p in parts] == [True, False, False]
        assert {p.revision for p in parts} == {mirror.revision}
        assert not parts[0].history.enabled, "no history store: jobs never leave etcd"
        watched = {w.job.id: w for p in parts for w in p.jobs}
        assert watched["job-run"].exits_from_allocation and [e.exit_code for e in watched["job-run"].job.exits] == [3]
        assert not watched["job-0"].exits_from_allocation
        progress = await stream.next()  # nothing changes: progress, at the same revision
        assert (progress.jobs, progress.deleted, progress.revision, progress.synced) == ([], [], mirror.revision, True)
        await store.delete(keys.job("job-1"))
        await store.delete(keys.allocation("job-2"))  # an allocation key alone says nothing of the job's record
        deleted = await stream.until(lambda m: m.deleted)
        assert list(deleted.deleted) == ["job-1"] and deleted.revision == mirror.revision
