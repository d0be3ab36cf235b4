"""Finished jobs leave etcd for the history store and stay readable (issue 14), against a real scheduler on
mTLS, a real etcd and a real SQLite history: archive, mark, expire after job_ttl_s; GetJob, ListJobs and a
retried idempotent submit answer from the history once the job has left etcd; a job archived before a crash
(SQL written, etcd not yet marked) is archived again exactly once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_core.rpc.server import secure_channel
from trainyard_core.security import identity, pki
from trainyard_core.security.tls import ClientTls
from trainyard_core.testing import postgres
from trainyard_core.testing.wait import eventually
from trainyard_scheduler import metrics
from trainyard_scheduler.app import SchedulerApp
from trainyard_scheduler.archive import archived
from trainyard_scheduler.domain.models import JobState, WorkerExit
from trainyard_scheduler.history.store import HistoryStore, JobFilter
from trainyard_scheduler.settings import SchedulerSettings
from trainyard_scheduler.state.codec import decode_job

from .builders import NOW, make_job

SPEC = types_pb2.JobSpec(name="t", command=["true"], resources=types_pb2.Resources(nodes=1, gpus_per_node=1))


def _settings(etcd_settings: dict[str, str], key_prefix: str, pki_dir: Path, url: str,
              **extra: object) -> SchedulerSettings:
    return SchedulerSettings.model_validate(dict(
        **etcd_settings, etcd_prefix=key_prefix.rstrip("/"), listen_port=0, leader_ttl_s=2,
        reconcile_interval_s=0.2, history_url=url, **pki.files_for(pki_dir, identity.SCHEDULER).settings(), **extra))


async def _leading(app: SchedulerApp) -> SchedulerApp:
    await app.start()

    async def leads() -> bool:
        return app.leadership.is_leader

    await eventually(leads, what="the scheduler to lead")
    return app


@pytest.fixture
def history_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'history.db'}"


@pytest.fixture
async def leader(etcd_settings: dict[str, str], key_prefix: str, pki_dir: Path,
                 history_url: str) -> AsyncIterator[SchedulerApp]:
    app = SchedulerApp(_settings(etcd_settings, key_prefix, pki_dir, history_url, job_ttl_s=1))
    try:
        yield await _leading(app)
    finally:
        await app.stop()


async def test_a_finished_job_leaves_etcd_and_is_still_read_whole(leader: SchedulerApp, pki_dir: Path,
                                                                  history_url: str) -> None:
    address = f"127.0.0.1:{leader.grpc_port}"
    async with secure_channel(address, ClientTls(pki.files_for(pki_dir, identity.GATEWAY)), identity.SCHEDULER) as ch:
        jobs = scheduler_pb2_grpc.JobServiceStub(ch)
        submit = scheduler_pb2.SubmitJobRequest(spec=SPEC, team="team-a", user="bob", idempotency_key="k-1")
        job = (await jobs.SubmitJob(submit)).job
        idem = await leader.store.get(leader.keys.idempotency("team-a", "k-1"))
        assert idem is not None and idem.lease, "an idempotency key is bound to a lease: it expires"
        await jobs.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job.id, team="team-a", user="alice"))
        live = await jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=SPEC, team="team-a", user="bob"))

        async def gone() -> bool:
            return await leader.store.get(leader.keys.job(job.id)) is None

        await eventually(gone, what="the cancelled job to leave etcd after job_ttl_s", timeout=20)
        store = await HistoryStore.open(history_url)
        try:
            kept = await store.get(job.id)
            assert kept is not None and kept.state == "cancelled" and kept.team == "team-a" and await store.count() == 1
        finally:
            await store.close()

        got = (await jobs.GetJob(scheduler_pb2.GetJobRequest(job_id=job.id, team="team-a"))).job
        assert (got.state, got.cancelled_by, got.user) == (types_pb2.JOB_STATE_CANCELLED, "alice", "bob")
        listed = (await jobs.ListJobs(scheduler_pb2.ListJobsRequest(team="team-a"))).jobs
        assert [j.id for j in listed] == [live.job.id, job.id], "etcd and history merged, once each, newest first"
        cancelled = await jobs.ListJobs(scheduler_pb2.ListJobsRequest(
            team="team-a", states=[types_pb2.JOB_STATE_CANCELLED]))
        assert [j.id for j in cancelled.jobs] == [job.id]
        paged = await jobs.ListJobs(scheduler_pb2.ListJobsRequest(team="team-a", page_size=1))
        assert [j.id for j in paged.jobs] == [live.job.id] and paged.next_page_token
        rest = await jobs.ListJobs(scheduler_pb2.ListJobsRequest(team="team-a", page_size=1,
                                                                 page_token=paged.next_page_token))
        assert [j.id for j in rest.jobs] == [job.id]
        # A retry of the first submit (same key) is answered with that job, from the history.
        again = (await jobs.SubmitJob(submit)).job
        assert again.id == job.id and again.state == types_pb2.JOB_STATE_CANCELLED
        # Another team sees nothing of it.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await jobs.GetJob(scheduler_pb2.GetJobRequest(job_id=job.id, team="team-b"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_job_archived_before_a_crash_is_archived_once_more_and_once_only(
        etcd_settings: dict[str, str], key_prefix: str, pki_dir: Path, history_url: str) -> None:
    """The leader wrote the job to the history and died before marking it in etcd: the next leader writes it
    again, which leaves exactly one row, as etcd has it."""
    app = SchedulerApp(_settings(etcd_settings, key_prefix, pki_dir, history_url, job_ttl_s=3600))
    try:
        done = replace(make_job("job-crash", team="team-a"), state=JobState.FAILED, finished_at=NOW + 10,
                       message="rank 0 failed")
        store = await HistoryStore.open(history_url)
        try:
            # What the crashed leader wrote to the history, before the job is in etcd for the next one.
            await store.archive([archived(replace(done, message="as the crashed leader saw it"))])
            await app.start()
            await app._repo.create_job(done)

            async def marked() -> bool:
                kv = await app.store.get(app.keys.job(done.id))
                return kv is not None and b'"archived_at":null' not in kv.value

            await eventually(marked, what="the next leader to archive the job", timeout=20)
            kept = await store.get(done.id)
            assert await store.count() == 1 and kept is not None
            assert b"rank 0 failed" in kept.record, "the row is the job as etcd has it"

            async def no_backlog() -> bool:
                return bool(metrics.HISTORY_BACKLOG._value.get() == 0)

            await eventually(no_backlog, what="the backlog gauge to say nothing is left")
        finally:
            await store.close()
    finally:
        await app.stop()


async def test_a_write_after_the_archive_is_archived_too(
        etcd_settings: dict[str, str], key_prefix: str, pki_dir: Path, history_url: str) -> None:
    """A rank's exit reported after the job was archived (and marked) changes its record in etcd: the job is
    written to the history again before it leaves etcd, so the history has every exit."""
    app = SchedulerApp(_settings(etcd_settings, key_prefix, pki_dir, history_url, job_ttl_s=3))
    try:
        exits = tuple(WorkerExit(rank=r, node_id="n-a", exit_code=0, signal=0, at=NOW + 5) for r in range(3))
        done = replace(make_job("job-late-exit", team="team-a"), state=JobState.CANCELLED, finished_at=NOW + 10,
                       exits=exits)
        await app.start()
        await app._repo.create_job(done)

        async def marked() -> bool:
            found = await app._repo.get_job(done.id)
            return found is not None and found[0].archived_at is not None

        await eventually(marked, what="the job to be archived", timeout=20)
        late = WorkerExit(rank=3, node_id="n-b", exit_code=0, signal=15, at=NOW + 12)
        assert await app._repo.exits.record(done.id, done.attempt, late)

        async def gone() -> bool:
            return await app.store.get(app.keys.job(done.id)) is None

        await eventually(gone, what="the job to leave etcd", timeout=30)
        store = await HistoryStore.open(history_url)
        try:
            kept = await store.get(done.id)
            assert kept is not None
            assert [e.rank for e in decode_job(kept.record).exits] == [0, 1, 2, 3], "the late exit is archived"
            assert await store.count() == 1
        finally:
            await store.close()
    finally:
        await app.stop()


class _Relay:
    """TCP to the database that can go down: while down, every connection is closed and new ones are closed
    at once (what a stopped or unreachable server looks like to its clients); up again, it relays."""

    def __init__(self, target_port: int) -> None:
        self._target = target_port
        self._writers: set[asyncio.StreamWriter] = set()
        self.is_down = False
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> _Relay:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def down(self) -> None:
        self.is_down = True
        for w in list(self._writers):
            w.close()

    async def close(self) -> None:
        self.down()
        if self._server is not None:
            self._server.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.is_down:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._target)
        self._writers.update((writer, up_writer))

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()
                self._writers.discard(dst)

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))


async def test_a_history_store_that_is_down_delays_archiving_and_loses_nothing(
        etcd_settings: dict[str, str], key_prefix: str, pki_dir: Path) -> None:
    """The database unreachable while jobs finish: they stay in etcd, readable, counted in the backlog; once it
    answers again every one is archived exactly once and leaves etcd."""
    server = await asyncio.to_thread(postgres.start)
    relay = await _Relay(server.port).start()
    url = server.url().replace(f":{server.port}/", f":{relay.port}/")
    app = SchedulerApp(_settings(etcd_settings, key_prefix, pki_dir, url, job_ttl_s=0))
    try:
        await _leading(app)
        relay.down()
        address = f"127.0.0.1:{app.grpc_port}"
        async with secure_channel(address, ClientTls(pki.files_for(pki_dir, identity.GATEWAY)),
                                  identity.SCHEDULER) as ch:
            jobs = scheduler_pb2_grpc.JobServiceStub(ch)
            ids = []
            for i in range(5):
                job = (await jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=SPEC, team="team-a",
                                                                           user=f"u{i}"))).job
                await jobs.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job.id, team="team-a", user="alice"))
                ids.append(job.id)

            async def backlog() -> bool:
                return bool(metrics.HISTORY_BACKLOG._value.get() == 5)

            await eventually(backlog, what="the finished jobs to wait in the backlog", timeout=20)
            for job_id in ids:  # still in etcd, and read from there
                assert await app.store.get(app.keys.job(job_id)) is not None
                got = (await jobs.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id, team="team-a"))).job
                assert got.state == types_pb2.JOB_STATE_CANCELLED
            # Reads that need the history say so, and what to do.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await jobs.GetJob(scheduler_pb2.GetJobRequest(job_id="job-01hf00000000000000", team="team-a"))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "history store" in err.value.details()

            relay.is_down = False

            async def all_left_etcd() -> bool:
                return all([await app.store.get(app.keys.job(j)) is None for j in ids])

            await eventually(all_left_etcd, what="every job archived and removed from etcd", timeout=30)
            store = await HistoryStore.open(server.url())
            try:
                assert await store.count() == 5
                assert sorted(a.job_id for a in await store.list(JobFilter(team="team-a"), limit=10)) == ids
            finally:
                await store.close()
            listed = (await jobs.ListJobs(scheduler_pb2.ListJobsRequest(team="team-a"))).jobs
            assert [j.id for j in listed] == ids[::-1], "newest first"
    finally:
        await app.stop()
        await relay.close()
        await asyncio.to_thread(postgres.stop_and_clean, server)
