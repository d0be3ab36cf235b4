"""Commit on POSIX storage: every shard read back and checked against its declared checksum, the manifest
written last (atomically, once), lineage recorded; and what `commit_verify=size` leaves out."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from trainyard.checkpoint.v1 import checkpoint_pb2 as pb
from trainyard.checkpoint.v1 import checkpoint_pb2_grpc as pb_grpc
from trainyard_checkpoint.app import CheckpointApp
from trainyard_checkpoint.settings import CheckpointSettings
from trainyard_checkpoint.storage import PosixStorage
from trainyard_core.clock import ManualClock
from trainyard_core.errors import FailedPrecondition
from trainyard_core.rpc.server import insecure_channel
from trainyard_core.store.api import KeyValue
from trainyard_core.store.etcd import EtcdStore

from .checkpoint_support import (
    TEST_CHUNK_BYTES,
    Client,
    checksum_of,
    dcp_like_files,
    location_dir,
    rpc_error,
    write_shards,
)

JOB = "job-commit"


async def test_flipped_byte_is_refused_naming_shard_and_chunk(client: Client, etcd_store: EtcdStore,
                                                              key_prefix: str) -> None:
    good = await client.save(JOB, step=1)
    ckpt = await client.begin(JOB, step=2)
    files = dcp_like_files(world_size=2, step=2, size=100)
    shards = write_shards(ckpt, files)
    victim = location_dir(ckpt.location) / "__0_0.distcp"
    data = bytearray(victim.read_bytes())
    data[3 * TEST_CHUNK_BYTES] ^= 0x01
    victim.write_bytes(bytes(data))
    audit_log = key_prefix.rstrip("/") + "/audit/"  # a refused call is recorded there, by design

    async def state() -> list[KeyValue]:
        return [kv for kv in (await etcd_store.range(key_prefix)).kvs if not kv.key.startswith(audit_log)]

    before = await state()

    err = await rpc_error(client.commit(ckpt.id, shards))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = err.details() or ""
    assert "shard '__0_0.distcp' (rank 0) does not match its checksum: chunk 3 (bytes 48-63) differs" in details
    assert "stays WRITING" in details
    assert await state() == before, "a refused commit writes nothing"
    assert not (location_dir(ckpt.location) / ".trainyard-manifest.json").exists()
    assert (await client.latest(JOB)).id == good.id

    victim.write_bytes(files["__0_0.distcp"][1])
    assert (await client.commit(ckpt.id, shards)).state == pb.CHECKPOINT_STATE_COMMITTED
    assert (await client.latest(JOB)).id == ckpt.id


async def test_every_bad_shard_is_named(client: Client) -> None:
    ckpt = await client.begin(JOB, step=1, world_size=3)
    shards = write_shards(ckpt, dcp_like_files(world_size=3, step=1, size=40))
    directory = location_dir(ckpt.location)
    (directory / "__0_0.distcp").unlink()
    (directory / "__2_0.distcp").write_bytes(b"\0" * shards[2].size_bytes)
    err = await rpc_error(client.commit(ckpt.id, shards))
    details = err.details() or ""
    # Sizes are checked first: a missing shard is reported without reading the others.
    assert "'__0_0.distcp' (rank 0) is missing" in details
    (directory / "__0_0.distcp").write_bytes(b"\0" * shards[0].size_bytes)
    err = await rpc_error(client.commit(ckpt.id, shards))
    details = err.details() or ""
    assert "'__0_0.distcp' (rank 0) does not match" in details and "'__2_0.distcp' (rank 2) does not match" in details
    assert "'__1_0.distcp'" not in details


async def test_manifest_is_written_with_lineage(client: Client, clock: ManualClock) -> None:
    spec = json.dumps({"name": "train-7b", "resources": {"nodes": 2, "gpus_per_node": 8}})
    lineage = pb.Lineage(job_spec=spec, code_version="git:0123abcd", parameters={"lr": "3e-4", "batch": "1024"})
    ckpt = await client.begin(JOB, step=500, world_size=2, attempt=3, lineage=lineage, metadata={"note": "x"})
    assert ckpt.lineage == lineage and ckpt.manifest_path == ""
    shards = write_shards(ckpt, dcp_like_files(world_size=2, step=500))
    clock.advance(12)
    committed = await client.commit(ckpt.id, shards)
    assert committed.lineage == lineage and committed.manifest_path == ".trainyard-manifest.json"
    assert (committed.created_at.ToSeconds(), committed.committed_at.ToSeconds()) == \
        (ckpt.created_at.ToSeconds(), ckpt.created_at.ToSeconds() + 12)

    manifest_file = location_dir(ckpt.location) / ".trainyard-manifest.json"
    doc = json.loads(manifest_file.read_text())
    assert doc["format"] == "trainyard-checkpoint-manifest" and doc["version"] == 1
    assert (doc["checkpoint_id"], doc["job_id"], doc["attempt"], doc["step"], doc["world_size"]) == \
        (ckpt.id, JOB, 3, 500, 2)
    assert doc["lineage"] == {"job_spec": spec, "code_version": "git:0123abcd",
                              "parameters": {"lr": "3e-4", "batch": "1024"}}
    assert [s["path"] for s in doc["shards"]] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert doc["total_bytes"] == committed.total_bytes
    assert [p.name for p in manifest_file.parent.iterdir() if ".tmp-" in p.name] == [], "no temporary left"

    # A retried commit finds the same manifest and answers as the first time.
    clock.advance(5)
    assert await client.commit(ckpt.id, list(reversed(shards))) == committed


async def test_manifest_written_once_refuses_other_content(tmp_path: Path) -> None:
    storage = PosixStorage(tmp_path / "root")
    storage.ensure_root()
    location = storage.location_for("job-a", "ckpt-1")
    await storage.prepare(location)
    await storage.write_once(location, ".trainyard-manifest.json", b"first")
    await storage.write_once(location, ".trainyard-manifest.json", b"first")
    with pytest.raises(FailedPrecondition, match=r"already exists .* with other content"):
        await storage.write_once(location, ".trainyard-manifest.json", b"second")
    directory = tmp_path / "root" / "job-a" / "ckpt-1"
    assert (directory / ".trainyard-manifest.json").read_bytes() == b"first"
    assert sorted(p.name for p in directory.iterdir()) == [".trainyard-manifest.json"]
    with pytest.raises(FailedPrecondition, match="does not exist"):
        missing = storage.location_for("job-a", "ckpt-2")
        await storage.write_once(missing, ".trainyard-manifest.json", b"x")


@pytest.fixture
async def size_only_client(settings: CheckpointSettings, clock: ManualClock) -> AsyncIterator[Client]:
    app = CheckpointApp(settings.model_copy(update={"commit_verify": "size"}), clock=clock)
    await app.start()
    try:
        async with insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
            yield Client(pb_grpc.CheckpointServiceStub(channel))
    finally:
        await app.stop()


async def test_size_mode_checks_sizes_only_and_accepts_crc32c(size_only_client: Client) -> None:
    client = size_only_client
    ckpt = await client.begin(JOB, step=1, world_size=1)
    directory = location_dir(ckpt.location)
    (directory / "__0_0.distcp").write_bytes(b"a" * 50)
    shards = [pb.ShardInfo(path="__0_0.distcp", size_bytes=50, checksum=checksum_of(b"b" * 50), rank=0),
              pb.ShardInfo(path=".metadata", size_bytes=0, checksum="crc32c:0badf00d", rank=0)]
    (directory / ".metadata").write_bytes(b"")
    committed = await client.commit(ckpt.id, shards)
    assert committed.state == pb.CHECKPOINT_STATE_COMMITTED, "contents are not read in size mode"

    other = await client.begin(JOB, step=2, world_size=1)
    (location_dir(other.location) / "__0_0.distcp").write_bytes(b"a" * 49)
    err = await rpc_error(client.commit(other.id, shards[:1]))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "truncated" in (err.details() or "")
