"""etcd at its space quota (real etcd with a 16 MiB `--quota-backend-bytes`): the NOSPACE alarm refuses writes.

The store answers StoreOutOfSpace, a definite refusal (RESOURCE_EXHAUSTED, HTTP 507) that names the alarm
and the runbook, logged once, never a failover; what was written before stays readable, the refused write is
absent, reads and deletes go on; and the recovery docs/operations.md gives ("etcd space": compact, defragment
each member, disarm) brings writes back. Then the same through the scheduler's SubmitJob over gRPC.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from collections.abc import Iterator

import grpc
import grpc.aio
import pytest

from trainyard.common.v1 import types_pb2
from trainyard.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from trainyard_core import errors
from trainyard_core.rpc.errors import from_rpc_error, status_for
from trainyard_core.store import Put
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.store.etcd_options import EtcdOptions
from trainyard_core.testing import etcd as etcd_proc
from trainyard_core.testing.etcd_secure import settings_of
from trainyard_core.testing.wait import eventually
from trainyard_gateway.http_errors import domain_error_response
from trainyard_scheduler.app import SchedulerApp
from trainyard_scheduler.settings import SchedulerSettings

QUOTA = 16 * 1024 * 1024
VALUE = 256 * 1024
FILL = "/fill/"  # outside the scheduler's prefix, so its mirror never copies the filler


@pytest.fixture
def small_etcd() -> Iterator[etcd_proc.EtcdProcess]:
    member = etcd_proc.start_single(extra_args=["--quota-backend-bytes", str(QUOTA)])
    try:
        yield member
    finally:
        etcd_proc.stop_and_clean(member)


def etcdctl(member: etcd_proc.EtcdProcess, *args: str) -> str:
    done = subprocess.run(["etcdctl", f"--endpoints={member.client_url}", *member.etcdctl_tls(), *args],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "ETCDCTL_API": "3"})
    assert done.returncode == 0, f"etcdctl {' '.join(args)}: {done.stderr}"
    return done.stdout


async def fill(store: EtcdStore) -> tuple[dict[str, bytes], str, errors.StoreOutOfSpace]:
    """Put values under FILL until etcd refuses one: (what was written, the refused key, the error)."""
    written: dict[str, bytes] = {}
    for i in range(4 * QUOTA // VALUE):
        key, value = f"{FILL}{i:05d}", os.urandom(VALUE)
        try:
            await store.put(key, value)
        except errors.StoreOutOfSpace as exc:
            return written, key, exc
        written[key] = value
    pytest.fail(f"etcd took {4 * QUOTA} bytes under a quota of {QUOTA}")


async def read_all(store: EtcdStore) -> dict[str, bytes]:
    """Everything under FILL, a few values a page (the whole of it is over gRPC's 4 MiB message limit)."""
    out: dict[str, bytes] = {}
    after: str | None = None
    while True:
        page = await store.range(FILL, start_after=after, limit=8)
        out.update((kv.key, kv.value) for kv in page.kvs)
        if not page.more:
            return out
        after = page.kvs[-1].key


def recover(member: etcd_proc.EtcdProcess) -> None:
    """docs/operations.md, "etcd space": compact to the current revision, defragment, disarm the alarm."""
    [status] = json.loads(etcdctl(member, "endpoint", "status", "-w", "json"))
    etcdctl(member, "compaction", "--physical", str(status["Status"]["header"]["revision"]))
    etcdctl(member, "defrag")
    etcdctl(member, "alarm", "disarm")
    assert etcdctl(member, "alarm", "list").strip() == ""


async def test_a_full_store_refuses_writes_definitely_and_recovers(
        small_etcd: etcd_proc.EtcdProcess, caplog: pytest.LogCaptureFixture) -> None:
    # A second endpoint that is not there: the alarm is the whole cluster's, so a refusal must not move on.
    store = EtcdStore(f"{small_etcd.endpoint},127.0.0.1:{etcd_proc.free_port()}")
    try:
        lease = await store.grant_lease(60)
        with caplog.at_level(logging.ERROR, logger="trainyard_core.store.etcd"):
            written, refused, exc = await fill(store)
        assert len(written) * VALUE > QUOTA // 2
        assert isinstance(exc, errors.ResourceExhausted) and isinstance(exc, errors.Unavailable)
        assert status_for(exc) == grpc.StatusCode.RESOURCE_EXHAUSTED
        for words in ("etcd is out of space", f"transaction of {refused}", "refused and not applied",
                      "NOSPACE", "--quota-backend-bytes", 'docs/operations.md, "etcd space"',
                      "database space exceeded"):
            assert words in exc.message, words
        [record] = [r for r in caplog.records if r.getMessage() == "etcd is out of space: a write was refused"]
        assert record.levelno == logging.ERROR
        assert record.__dict__["key"] == refused and record.__dict__["alarm"] == "NOSPACE"
        assert store.endpoint == small_etcd.endpoint
        assert "alarm:NOSPACE" in etcdctl(small_etcd, "alarm", "list")

        # Nothing was lost and nothing half-written: every earlier value reads back, the refused key is absent.
        assert await read_all(store) == written
        assert await store.get(refused) is None
        # Every write is refused while the alarm is raised, however small, and so are new leases; reads,
        # read-only transactions, keepalives and deletes go on.
        with pytest.raises(errors.StoreOutOfSpace):
            await store.txn([], [Put(f"{FILL}small", b"x")])
        with pytest.raises(errors.StoreOutOfSpace, match="a lease grant was refused"):
            await store.grant_lease(10)
        assert (await store.txn([], [])).succeeded
        assert await store.keepalive(lease) > 0
        doomed = sorted(written)[: len(written) // 2]
        for key in doomed:
            assert await store.delete(key)
        # Deleting frees nothing by itself: the alarm stays until an operator disarms it.
        with pytest.raises(errors.StoreOutOfSpace):
            await store.put(f"{FILL}small", b"x")

        recover(small_etcd)
        await store.put(f"{FILL}small", b"x")
        assert (await store.get(f"{FILL}small")) is not None
        assert await store.grant_lease(10) > 0
        assert len(await read_all(store)) == len(written) - len(doomed) + 1
    finally:
        await store.close()


async def test_submit_job_answers_resource_exhausted_and_reads_go_on(small_etcd: etcd_proc.EtcdProcess) -> None:
    settings = SchedulerSettings.model_validate({**settings_of(EtcdOptions(endpoints=small_etcd.endpoint)),
                                                 "etcd_prefix": "/nospace", "listen_port": 0, "leader_ttl_s": 2,
                                                 "reconcile_interval_s": 0.2})
    app = SchedulerApp(settings)
    await app.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}")
    store = EtcdStore(small_etcd.endpoint)
    try:
        async def leads() -> bool:
            return app.leadership.is_leader

        await eventually(leads, what="the scheduler leads")
        jobs = scheduler_pb2_grpc.JobServiceStub(channel)
        spec = types_pb2.JobSpec(name="it", command=["true"], resources=types_pb2.Resources(nodes=1, gpus_per_node=1))
        before = (await jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec))).job
        await fill(store)

        with pytest.raises(grpc.aio.AioRpcError) as info:
            await jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec), timeout=20)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
        assert "etcd is out of space" in (info.value.details() or "")
        assert "not applied" in (info.value.details() or "")
        # The gateway's clients turn it back into the same error, and the gateway answers 507 without Retry-After.
        err = from_rpc_error(info.value, "scheduler")
        assert isinstance(err, errors.StoreOutOfSpace)
        reply = domain_error_response(err)
        assert reply.status_code == 507 and "retry-after" not in reply.headers
        body = json.loads(bytes(reply.body))
        assert body["error"]["code"] == "insufficient_storage" and "etcd is out of space" in body["error"]["message"]

        # Reads are served meanwhile, and the replica keeps leading (keepalives are not writes).
        got = (await jobs.GetJob(scheduler_pb2.GetJobRequest(job_id=before.id))).job
        assert got.id == before.id
        listed = (await jobs.ListJobs(scheduler_pb2.ListJobsRequest())).jobs
        assert [j.id for j in listed] == [before.id]
        assert app.leadership.is_leader

        # The filler is live data: compaction and defragmentation alone would leave the database full.
        for key in await read_all(store):
            await store.delete(key)
        recover(small_etcd)
        after = (await jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec), timeout=20)).job
        assert after.id != before.id
    finally:
        await store.close()
        await channel.close()
        await app.stop()
