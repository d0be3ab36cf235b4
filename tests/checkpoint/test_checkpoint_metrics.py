"""The checkpoint-store's /metrics after real saves, a refused commit, an abort, a load and GC passes, through the
real service (etcd, gRPC, a real directory), served as the process serves it (`telemetry.start_metrics_server`
on the settings' metrics host and port) and parsed with Prometheus' text parser. The service's clock is the
test's, so the durations it reads from its records are exact."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from trainyard.checkpoint.v1 import checkpoint_pb2 as pb
from trainyard_checkpoint.app import CheckpointApp
from trainyard_checkpoint.settings import CheckpointSettings
from trainyard_core import telemetry
from trainyard_core.clock import ManualClock
from trainyard_core.testing.etcd import free_port
from trainyard_core.testing.metrics import Scrape, scrape

from .checkpoint_support import Client, dcp_like_files, rpc_error, write_shards
from .conftest import client_of, running_app

JOB = "job-metrics"
SERVICE = "trainyard.checkpoint.v1.CheckpointService"


@pytest.fixture
async def served(settings: CheckpointSettings, clock: ManualClock) -> AsyncIterator[tuple[CheckpointApp, int]]:
    with_metrics = settings.model_copy(update={"metrics_host": "127.0.0.1", "metrics_port": free_port()})
    port = telemetry.start_metrics_server(with_metrics.metrics_host, with_metrics.metrics_port)
    assert port == with_metrics.metrics_port
    async with running_app(with_metrics, clock) as app:
        yield app, port


def _delta(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
    return after.total(name, **labels) - before.total(name, **labels)


def _bytes(ckpt: pb.Checkpoint) -> int:
    return sum(s.size_bytes for s in ckpt.shards)


async def test_saves_commits_loads_and_gc_are_measured(served: tuple[CheckpointApp, int], clock: ManualClock) -> None:
    app, port = served
    before = await scrape("127.0.0.1", port)
    async with client_of(app) as client:
        # A save whose ranks took 42 s to write their shards.
        first = await client.begin(JOB, step=100, world_size=2)
        clock.advance(42)
        first = await client.commit(first.id, write_shards(first, dcp_like_files(2, 100, size=4096)))
        assert first.state == pb.CHECKPOINT_STATE_COMMITTED
        first_bytes = _bytes(first)
        assert first_bytes > 8192
        assert (await client.commit(first.id, list(first.shards))).state == pb.CHECKPOINT_STATE_COMMITTED  # a retry

        # A commit whose shards are not in storage is refused, then the save is aborted.
        broken = await client.begin(JOB, step=150, world_size=1)
        refused = await rpc_error(client.commit(broken.id, [pb.ShardInfo(path="__0_0.distcp", size_bytes=10,
                                                                         checksum="xxh3:" + "0" * 16, rank=0)]))
        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
        await client.abort(broken.id, "ranks gave up")

        # A load holding its restore lease for 7 s.
        lease = await client.acquire(first.id)
        clock.advance(7)
        await client.release(first.id, lease)
        await client.release(first.id, lease)  # idempotent: timed once

        middle = await client.save(JOB, step=200, world_size=1)
        last = await client.save(JOB, step=300, world_size=1)
        await client.set_retention(JOB, keep_last=1)
        assert await client.gc(dry_run=True) != []  # a dry run is no pass
        deleted = {a.checkpoint_id for a in await client.gc()}
        assert deleted == {first.id, middle.id}
        assert (await client.get(last.id)).state == pb.CHECKPOINT_STATE_COMMITTED
    after = await scrape("127.0.0.1", port)

    assert _delta(before, after, "trainyard_checkpoint_begun_total") == 4
    assert _delta(before, after, "trainyard_checkpoint_commits_total", result="committed") == 3
    assert _delta(before, after, "trainyard_checkpoint_commits_total", result="refused") == 1
    assert _delta(before, after, "trainyard_checkpoint_commits_total", result="failed") == 0
    assert _delta(before, after, "trainyard_checkpoint_commit_seconds_count") == 3
    saved = first_bytes + _bytes(middle) + _bytes(last)
    assert _delta(before, after, "trainyard_checkpoint_saved_bytes_total") == saved
    assert _delta(before, after, "trainyard_checkpoint_size_bytes_count") == 3
    assert _delta(before, after, "trainyard_checkpoint_size_bytes_sum") == saved
    assert _delta(before, after, "trainyard_checkpoint_save_seconds_count") == 3
    assert _delta(before, after, "trainyard_checkpoint_save_seconds_sum") == 42  # the others took no test time
    assert _delta(before, after, "trainyard_checkpoint_save_seconds_bucket", le="60.0") == 3
    assert _delta(before, after, "trainyard_checkpoint_save_seconds_bucket", le="30.0") == 2
    assert _delta(before, after, "trainyard_checkpoint_aborted_total") == 1
    assert _delta(before, after, "trainyard_checkpoint_loads_total") == 1
    assert _delta(before, after, "trainyard_checkpoint_load_bytes_total") == first_bytes
    assert _delta(before, after, "trainyard_checkpoint_load_seconds_count") == 1
    assert _delta(before, after, "trainyard_checkpoint_load_seconds_sum") == 7
    assert _delta(before, after, "trainyard_checkpoint_gc_runs_total", result="ok") == 1
    assert _delta(before, after, "trainyard_checkpoint_gc_seconds_count") == 1
    assert _delta(before, after, "trainyard_checkpoint_gc_removed_total", action="delete_by_retention") == 2
    assert _delta(before, after, "trainyard_checkpoint_gc_removed_bytes_total") == first_bytes + _bytes(middle)
    assert after.types["trainyard_checkpoint_save_seconds"] == "histogram"
    # The refused commit as its caller saw it, among the service's RPCs.
    assert _delta(before, after, "grpc_server_handled_total", grpc_type="unary", grpc_service=SERVICE,
                  grpc_method="CommitCheckpoint", grpc_code="FailedPrecondition") == 1
    assert _delta(before, after, "grpc_server_handled_total", grpc_service=SERVICE, grpc_method="CommitCheckpoint",
                  grpc_code="OK") == 4
    # No job or checkpoint id is a label value.
    ids = {JOB, first.id, broken.id, middle.id, last.id}
    values = {v for s in after.samples if s.name.startswith("trainyard_checkpoint_") for v in s.labels.values()}
    assert not values & ids


async def test_a_pass_skipped_for_the_lock_and_the_actions_of_an_abandoned_save(
        served: tuple[CheckpointApp, int], settings: CheckpointSettings, clock: ManualClock) -> None:
    app, port = served
    before = await scrape("127.0.0.1", port)
    other = CheckpointApp(settings, clock=clock)
    await other.start()
    try:
        assert other.gc is not None
        async with client_of(app) as client:
            lease = await other.gc._lock()  # another replica is in the middle of a pass
            assert (await rpc_error(client.gc())).code() == grpc.StatusCode.ABORTED
            await other.gc._repo.store.revoke_lease(lease)
            stuck = await client.begin(JOB, step=1, world_size=1)
            write_shards(stuck, dcp_like_files(1, 1))
            clock.advance(7 * 3600)
            await _gc(client)  # abandoned: aborted
            clock.advance(3600)
            await _gc(client)  # past the grace: its files removed
    finally:
        await other.stop()
    after = await scrape("127.0.0.1", port)
    assert _delta(before, after, "trainyard_checkpoint_gc_runs_total", result="skipped") == 1
    assert _delta(before, after, "trainyard_checkpoint_gc_runs_total", result="ok") == 2
    assert _delta(before, after, "trainyard_checkpoint_gc_removed_total", action="abort_abandoned") == 1
    assert _delta(before, after, "trainyard_checkpoint_gc_removed_total", action="remove_aborted") == 1
    assert _delta(before, after, "trainyard_checkpoint_aborted_total") == 1
    # An aborted save has no recorded size: its removal frees bytes the metric cannot know.
    assert _delta(before, after, "trainyard_checkpoint_gc_removed_bytes_total") == 0


async def _gc(client: Client) -> None:
    assert len(await client.gc()) == 1
