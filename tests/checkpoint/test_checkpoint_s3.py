"""The service side on S3: a real `moto_server` on 127.0.0.1, shards written with s3fs as a worker would,
the service verifying them, writing the manifest last, moving latest, deleting and collecting objects."""

from __future__ import annotations

import json
import logging
from typing import Any

import grpc
import pytest

from trainyard.checkpoint.v1 import checkpoint_pb2 as pb
from trainyard_checkpoint.app import CheckpointApp
from trainyard_checkpoint.settings import CheckpointSettings
from trainyard_checkpoint.storage.s3 import S3Storage
from trainyard_core.clock import ManualClock
from trainyard_core.errors import FailedPrecondition

from .checkpoint_support import TEST_CHUNK_BYTES, Client, checksum_of, dcp_like_files, rpc_error
from .conftest import S3_KEY, S3_SECRET, MotoServer

JOB = "job-s3"


def key_of(location: str) -> str:
    assert location.startswith("s3://"), location
    return location[len("s3://"):]


def put_shards(fs: Any, ckpt: pb.Checkpoint, files: dict[str, tuple[int, bytes]]) -> list[pb.ShardInfo]:
    """Upload `{path: (rank, data)}` under the checkpoint's location with s3fs; return the declarations."""
    base = key_of(ckpt.location)
    shards = []
    for path, (rank, data) in files.items():
        fs.pipe_file(f"{base}/{path}", data)
        shards.append(pb.ShardInfo(path=path, size_bytes=len(data), checksum=checksum_of(data), rank=rank))
    return shards


async def test_s3_round_trip(s3_client: Client, s3fs_client: Any, s3_bucket: str, s3_app: CheckpointApp,
                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="trainyard_checkpoint")
    caplog.set_level(logging.DEBUG, logger="s3fs")
    lineage = pb.Lineage(job_spec='{"name": "train-7b"}', code_version="abc123", parameters={"lr": "3e-4"})
    ckpt = await s3_client.begin(JOB, step=10, world_size=2, lineage=lineage)
    assert ckpt.location == f"s3://{s3_bucket}/checkpoints/{JOB}/{ckpt.id}"

    shards = put_shards(s3fs_client, ckpt, dcp_like_files(world_size=2, step=10, size=100))
    committed = await s3_client.commit(ckpt.id, shards)
    assert committed.state == pb.CHECKPOINT_STATE_COMMITTED
    assert committed.manifest_path == ".trainyard-manifest.json"
    assert committed.lineage == lineage

    manifest = json.loads(s3fs_client.cat_file(f"{key_of(ckpt.location)}/.trainyard-manifest.json"))
    assert manifest["checkpoint_id"] == ckpt.id and manifest["step"] == 10 and manifest["world_size"] == 2
    assert {(s["path"], s["size_bytes"], s["checksum"]) for s in manifest["shards"]} == \
        {(s.path, s.size_bytes, s.checksum) for s in shards}
    assert manifest["lineage"]["code_version"] == "abc123" and manifest["lineage"]["parameters"] == {"lr": "3e-4"}
    assert (await s3_client.latest(JOB)).id == ckpt.id

    newer = await s3_client.begin(JOB, step=20, world_size=2)
    await s3_client.commit(newer.id, put_shards(s3fs_client, newer, dcp_like_files(2, 20)))
    assert (await s3_client.latest(JOB)).id == newer.id

    await s3_client.delete(ckpt.id)
    assert (await s3_client.get(ckpt.id)).state == pb.CHECKPOINT_STATE_DELETED
    assert s3fs_client.find(key_of(ckpt.location)) == [], "delete removes every object of the checkpoint"
    assert len(s3fs_client.find(key_of(newer.location))) == 4, "the other checkpoint is untouched"

    assert S3_SECRET not in caplog.text and S3_KEY not in caplog.text


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
async def test_s3_bad_shard_is_refused_naming_it(s3_client: Client, s3fs_client: Any, damage: str) -> None:
    ckpt = await s3_client.begin(JOB, step=1, world_size=2)
    files = dcp_like_files(world_size=2, step=1, size=100)
    shards = put_shards(s3fs_client, ckpt, files)
    victim = f"{key_of(ckpt.location)}/__1_0.distcp"
    data = bytearray(files["__1_0.distcp"][1])
    if damage == "flip":
        data[2 * TEST_CHUNK_BYTES + 3] ^= 0xFF
        s3fs_client.pipe_file(victim, bytes(data))
    elif damage == "truncate":
        s3fs_client.pipe_file(victim, bytes(data[:-1]))
    else:
        s3fs_client.rm(victim)

    err = await rpc_error(s3_client.commit(ckpt.id, shards))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = err.details() or ""
    assert "'__1_0.distcp' (rank 1)" in details
    assert {"flip": "chunk 2 (bytes 32-47) differs", "truncate": "truncated", "delete": "missing"}[damage] in details
    assert (await s3_client.get(ckpt.id)).state == pb.CHECKPOINT_STATE_WRITING
    assert not s3fs_client.exists(f"{key_of(ckpt.location)}/.trainyard-manifest.json"), "no manifest before commit"

    # The checkpoint stays WRITING: the worker uploads the shard again and the commit goes through.
    s3fs_client.pipe_file(victim, files["__1_0.distcp"][1])
    assert (await s3_client.commit(ckpt.id, shards)).state == pb.CHECKPOINT_STATE_COMMITTED


@pytest.mark.parametrize("conditional", [True, False])
async def test_s3_manifest_is_written_once(moto_server: MotoServer, s3_bucket: str, s3fs_client: Any,
                                           conditional: bool) -> None:
    storage = S3Storage(s3_bucket, "p", endpoint_url=moto_server.endpoint, access_key_id=S3_KEY,
                        secret_access_key=S3_SECRET, conditional_writes=conditional)
    try:
        location = storage.location_for("job-a", "ckpt-0000000001aaaaaaaa")
        await storage.write_once(location, ".trainyard-manifest.json", b"first")
        await storage.write_once(location, ".trainyard-manifest.json", b"first")  # a retried commit
        with pytest.raises(FailedPrecondition, match=r"already exists .* with other content"):
            await storage.write_once(location, ".trainyard-manifest.json", b"second")
        assert s3fs_client.cat_file(f"{s3_bucket}/p/job-a/ckpt-0000000001aaaaaaaa/.trainyard-manifest.json") == b"first"
        with pytest.raises(FailedPrecondition, match="not under this storage's root"):
            await storage.remove(f"s3://{s3_bucket}/other/job-a/ckpt-0000000001aaaaaaaa")
        with pytest.raises(FailedPrecondition, match="not an s3:// URL of this storage"):
            await storage.remove("s3://another-bucket/p/job-a/ckpt-0000000001aaaaaaaa")
    finally:
        await storage.close()


async def test_s3_orphans_are_collected_after_the_grace(s3_client: Client, s3fs_client: Any, s3_bucket: str,
                                                        clock: ManualClock) -> None:
    kept = await s3_client.begin(JOB, step=1, world_size=1)
    await s3_client.commit(kept.id, put_shards(s3fs_client, kept, dcp_like_files(1, 1)))
    orphan = f"{s3_bucket}/checkpoints/{JOB}/ckpt-0000000001orphan00"
    s3fs_client.pipe_file(f"{orphan}/__0_0.distcp", b"left behind by a crashed begin")
    s3fs_client.pipe_file(f"{s3_bucket}/checkpoints/not-ours.txt", b"not a checkpoint location")

    assert await s3_client.gc() == [], "first seen now: still within the grace"
    clock.advance(3601)
    actions = await s3_client.gc()
    assert [(a.kind, a.checkpoint_id) for a in actions] == [(pb.GC_ACTION_KIND_REMOVE_ORPHAN,
                                                              "ckpt-0000000001orphan00")]
    assert s3fs_client.find(orphan) == []
    assert s3fs_client.exists(f"{s3_bucket}/checkpoints/not-ours.txt")
    assert len(s3fs_client.find(key_of(kept.location))) == 3


async def test_start_up_refuses_a_missing_bucket_without_leaking_the_secret(s3_settings: CheckpointSettings,
                                                                            clock: ManualClock) -> None:
    app = CheckpointApp(s3_settings.model_copy(update={"storage_url": "s3://no-such-bucket-here/p"}), clock=clock)
    with pytest.raises(OSError, match="S3 bucket 'no-such-bucket-here' not found") as info:
        await app.start()
    assert S3_SECRET not in str(info.value)
    await app.stop()
