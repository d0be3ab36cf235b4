"""Garbage collection through the real service (etcd, gRPC, a real directory): retention, abandoned and
aborted saves, orphans, tombstones, the GC lock, the background loop, and GC racing concurrent saves."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from trainyard.checkpoint.v1 import checkpoint_pb2 as pb
from trainyard.checkpoint.v1 import checkpoint_pb2_grpc as pb_grpc
from trainyard_checkpoint.app import CheckpointApp
from trainyard_checkpoint.domain import Checkpoint, CheckpointState, RetentionPolicy, keep_reasons
from trainyard_checkpoint.settings import CheckpointSettings
from trainyard_core.clock import ManualClock
from trainyard_core.rpc.server import insecure_channel
from trainyard_core.testing.wait import eventually

from .checkpoint_support import Client, dcp_like_files, location_dir, rpc_error, write_shards

JOB = "job-gc"
KIND = pb.GcActionKind


def summary(actions: list[pb.GcAction]) -> set[tuple[int, str]]:
    return {(a.kind, a.checkpoint_id) for a in actions}


async def test_retention_deletes_what_no_rule_keeps(client: Client) -> None:
    saved = {step: await client.save(JOB, step=step, world_size=1) for step in (100, 200, 300, 400, 500)}
    assert await client.gc() == [], "without a policy every checkpoint is kept"

    await client.set_retention(JOB, keep_last=2)
    await client.tag(saved[100].id, "best")
    lease = await client.acquire(saved[200].id)

    dry = await client.gc(dry_run=True)
    assert summary(dry) == {(KIND.GC_ACTION_KIND_DELETE_BY_RETENTION, saved[300].id)}
    assert "keep_last=2" in dry[0].reason
    assert (await client.get(saved[300].id)).state == pb.CHECKPOINT_STATE_COMMITTED, "a dry run changes nothing"

    assert summary(await client.gc()) == {(KIND.GC_ACTION_KIND_DELETE_BY_RETENTION, saved[300].id)}
    assert (await client.get(saved[300].id)).state == pb.CHECKPOINT_STATE_DELETED
    assert not location_dir(saved[300].location).exists()
    for step in (100, 200, 400, 500):
        assert (await client.get(saved[step].id)).state == pb.CHECKPOINT_STATE_COMMITTED, step
        assert location_dir(saved[step].location).is_dir(), step

    await client.release(saved[200].id, lease)
    assert summary(await client.gc()) == {(KIND.GC_ACTION_KIND_DELETE_BY_RETENTION, saved[200].id)}
    assert await client.gc() == []


async def test_retention_set_at_begin_and_read_back(client: Client) -> None:
    got = await client.stub.GetRetention(pb.GetRetentionRequest(job_id=JOB))
    assert not got.HasField("policy")
    await client.begin(JOB, step=1, retention=pb.RetentionPolicy(keep_last=3, keep_every_steps=1000))
    got = await client.stub.GetRetention(pb.GetRetentionRequest(job_id=JOB))
    assert (got.policy.keep_last, got.policy.keep_every_steps) == (3, 1000)
    await client.stub.SetRetention(pb.SetRetentionRequest(job_id=JOB))  # no policy: cleared
    assert not (await client.stub.GetRetention(pb.GetRetentionRequest(job_id=JOB))).HasField("policy")

    for request, message in [
        (pb.SetRetentionRequest(job_id=JOB, policy=pb.RetentionPolicy()), "keeps nothing but the latest"),
        (pb.SetRetentionRequest(job_id=JOB, policy=pb.RetentionPolicy(keep_last=-1)), "policy.keep_last"),
        (pb.SetRetentionRequest(job_id="Bad/Job", policy=pb.RetentionPolicy(keep_last=1)), "not a valid job id"),
    ]:
        err = await rpc_error(client.stub.SetRetention(request))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and message in (err.details() or ""), message
    err = await rpc_error(client.begin(JOB, step=2, retention=pb.RetentionPolicy(keep_every_steps=-1)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "retention.keep_every_steps" in (err.details() or "")


async def test_abandoned_save_is_aborted_then_removed_then_purged(client: Client, clock: ManualClock) -> None:
    stuck = await client.begin(JOB, step=1)
    write_shards(stuck, dcp_like_files(2, 1))
    clock.advance(6 * 3600 - 1)
    assert await client.gc() == [], "still within gc_abandon_writing_s"
    clock.advance(1)
    assert summary(await client.gc()) == {(KIND.GC_ACTION_KIND_ABORT_ABANDONED, stuck.id)}
    aborted = await client.get(stuck.id)
    assert aborted.state == pb.CHECKPOINT_STATE_ABORTED and aborted.abort_reason.startswith("abandoned")
    assert location_dir(stuck.location).is_dir(), "files stay through the grace: workers may still write"

    clock.advance(3600)
    assert summary(await client.gc()) == {(KIND.GC_ACTION_KIND_REMOVE_ABORTED, stuck.id)}
    assert (await client.get(stuck.id)).state == pb.CHECKPOINT_STATE_DELETED
    assert not location_dir(stuck.location).exists()

    clock.advance(7 * 86400)
    assert summary(await client.gc()) == {(KIND.GC_ACTION_KIND_PURGE_TOMBSTONE, stuck.id)}
    assert (await rpc_error(client.get(stuck.id))).code() == grpc.StatusCode.NOT_FOUND


async def test_orphans_and_stragglers_are_removed_after_the_grace(client: Client, storage_root: Path,
                                                                 clock: ManualClock) -> None:
    kept = await client.save(JOB, step=1)
    # A save aborted and deleted, then a straggling worker wrote into its directory again.
    straggled = await client.begin(JOB, step=2)
    await client.abort(straggled.id, "rank died")
    await client.delete(straggled.id)
    write_shards(straggled, {"__1_0.distcp": (1, b"late")})
    # Directories no record knows: a begin whose record write failed; and things that are not ours.
    orphan = storage_root / JOB / "ckpt-0000000001orphan00"
    orphan.mkdir()
    (orphan / "__0_0.distcp").write_bytes(b"x")
    (storage_root / JOB / "README").write_text("not a checkpoint")
    (storage_root / "Not An Id").mkdir()

    assert await client.gc() == []
    clock.advance(3600)
    assert summary(await client.gc()) == {(KIND.GC_ACTION_KIND_REMOVE_ORPHAN, "ckpt-0000000001orphan00"),
                                          (KIND.GC_ACTION_KIND_REMOVE_ORPHAN, straggled.id)}
    assert not orphan.exists() and not location_dir(straggled.location).exists()
    assert (storage_root / JOB / "README").exists() and (storage_root / "Not An Id").is_dir()
    assert location_dir(kept.location).is_dir()


async def test_only_one_replica_runs_gc_at_a_time(app: CheckpointApp, client: Client,
                                                  settings: CheckpointSettings, clock: ManualClock) -> None:
    other = CheckpointApp(settings, clock=clock)
    await other.start()
    try:
        assert other.gc is not None and app.gc is not None
        lease = await other.gc._lock()  # the other replica is in the middle of a pass
        err = await rpc_error(client.gc())
        assert err.code() == grpc.StatusCode.ABORTED and "already running on" in (err.details() or "")
        assert other.gc.identity in (err.details() or "")
        assert await client.gc(dry_run=True) == [], "a dry run needs no lock"
        await app.gc._repo.store.revoke_lease(lease)
        assert await client.gc() == []
    finally:
        await other.stop()


@pytest.fixture
async def looping_client(settings: CheckpointSettings, clock: ManualClock) -> AsyncIterator[Client]:
    app = CheckpointApp(settings.model_copy(update={"gc_interval_s": 0.05}), clock=clock)
    await app.start()
    try:
        async with insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
            yield Client(pb_grpc.CheckpointServiceStub(channel))
    finally:
        await app.stop()


async def test_background_loop_applies_retention(looping_client: Client) -> None:
    client = looping_client
    first = await client.save(JOB, step=1)
    await client.save(JOB, step=2)
    await client.set_retention(JOB, keep_last=1)

    async def collected() -> bool:
        # The record is marked DELETED first, then its files go (never a COMMITTED record without files).
        return ((await client.get(first.id)).state == pb.CHECKPOINT_STATE_DELETED
                and not location_dir(first.location).exists())

    await eventually(collected, timeout=10, what="the GC loop to delete the old checkpoint, record and files")


async def test_gc_racing_concurrent_saves_keeps_what_it_must(
        app: CheckpointApp, client: Client, settings: CheckpointSettings, clock: ManualClock) -> None:
    """Writers save concurrently (some commits land after newer ones), others tag and lease, two replicas
    run GC over and over. Latest, tagged, leased and WRITING checkpoints are never deleted; at the end
    exactly what retention does not keep is gone, files and all."""
    policy = RetentionPolicy(keep_last=2, keep_every_steps=1000)
    await client.set_retention(JOB, keep_last=policy.keep_last, keep_every_steps=policy.keep_every_steps)
    replica = CheckpointApp(settings, clock=clock)
    await replica.start()
    channel = insecure_channel(f"127.0.0.1:{replica.grpc_port}")
    other = Client(pb_grpc.CheckpointServiceStub(channel))
    rng = random.Random(5)
    next_step = iter(range(100, 100_000, 100))
    committed: list[str] = []
    left_writing: list[str] = []
    tagged: set[str] = set()
    leased: set[str] = set()
    writers_done = asyncio.Event()
    gc_passes = 0

    async def writer(c: Client, saves: int) -> None:
        for _ in range(saves):
            step = next(next_step)
            try:
                ckpt = await c.begin(JOB, step=step, world_size=1)
            except grpc.aio.AioRpcError as e:  # another writer's higher step was committed first
                assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, e
                continue
            shards = write_shards(ckpt, dcp_like_files(1, step, size=32))
            await asyncio.sleep(rng.random() / 100)  # commits land out of step order
            if rng.random() < 0.15:
                left_writing.append(ckpt.id)  # a save that never finishes (within the abandon time)
                continue
            committed.append((await c.commit(ckpt.id, shards)).id)

    async def protector() -> None:
        while not writers_done.is_set():
            await asyncio.sleep(0.01)
            if not committed:
                continue
            target = rng.choice(committed)
            try:
                if rng.random() < 0.5:
                    await client.tag(target, "keep")
                    tagged.add(target)
                else:
                    await other.acquire(target, ttl_s=600, holder="restorer")
                    leased.add(target)
            except grpc.aio.AioRpcError as e:  # GC deleted it first: it is no longer COMMITTED
                assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, e
                assert "DELETED" in (e.details() or "")

    async def collector(c: Client) -> None:
        nonlocal gc_passes
        while not writers_done.is_set():
            try:
                await c.gc()
                gc_passes += 1
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.ABORTED, e  # the other replica holds the lock
            await check_invariants()
            await asyncio.sleep(0.005)

    async def check_invariants() -> None:
        if committed:
            latest = await client.latest(JOB)
            assert (location_dir(latest.location) / ".trainyard-manifest.json").exists()
        for cid in [*tagged, *leased]:
            assert (await client.get(cid)).state == pb.CHECKPOINT_STATE_COMMITTED, cid
        for cid in left_writing:
            assert (await client.get(cid)).state == pb.CHECKPOINT_STATE_WRITING, cid

    try:
        async def writers() -> None:
            await asyncio.gather(writer(client, 12), writer(other, 12), writer(client, 12))
            writers_done.set()

        await asyncio.gather(writers(), protector(), collector(client), collector(other))
        await client.gc()
        await check_invariants()
        assert gc_passes >= 3

        records: list[Checkpoint] = []
        async for page in _pages(client):
            records.extend(page)
        latest = await client.latest(JOB)
        leases = {cid: 1 for cid in leased}
        reasons = keep_reasons([r for r in records if r.state is not CheckpointState.DELETED], policy,
                               latest_id=latest.id, leased=leases)
        states = {r.id: r for r in records}
        for cid in committed:
            record = states[cid]
            kept = bool(reasons.get(cid))
            assert record.state is (CheckpointState.COMMITTED if kept else CheckpointState.DELETED), (cid, reasons)
            assert location_dir(record.location).exists() is kept, cid
        assert any(r.state is CheckpointState.DELETED for r in records), "retention deleted something"
    finally:
        await channel.close()
        await replica.stop()


async def _pages(client: Client) -> AsyncIterator[list[Checkpoint]]:
    """Every checkpoint of JOB as domain records (states and locations are what the test needs)."""
    token = ""
    while True:
        resp = await client.stub.ListCheckpoints(pb.ListCheckpointsRequest(job_id=JOB, page_token=token))
        yield [Checkpoint(id=c.id, job_id=c.job_id, attempt=c.attempt, step=c.step, world_size=c.world_size,
                          location=c.location, state=CheckpointState(pb.CheckpointState.Name(c.state).split("_")[-1]),
                          created_at=c.created_at.ToSeconds(), tags=tuple(c.tags),
                          committed_at=c.committed_at.ToNanoseconds() / 1e9 if c.HasField("committed_at") else None)
               for c in resp.checkpoints]
        token = resp.next_page_token
        if not token:
            return
