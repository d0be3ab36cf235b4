"""The checkpoint-store through a real gRPC channel, against the real etcd and a real directory."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from trainyard.checkpoint.v1 import checkpoint_pb2 as pb
from trainyard.checkpoint.v1 import checkpoint_pb2_grpc as pb_grpc
from trainyard_checkpoint.app import CheckpointApp
from trainyard_checkpoint.settings import CheckpointSettings
from trainyard_core.clock import ManualClock
from trainyard_core.ids import new_id
from trainyard_core.rpc.server import insecure_channel
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.store.memory import MemoryStore

from .checkpoint_support import Client, checksum_of, dcp_like_files, location_dir, rpc_error, write_shards

JOB = "job-ckpt-test"


async def snapshot(store: EtcdStore, key_prefix: str) -> dict[str, tuple[bytes, int]]:
    """Every key the service wrote under the test's prefix, with its mod revision, but the audit log's (a
    refused call is recorded there, by design)."""
    result = await store.range(key_prefix)
    audit_log = key_prefix.rstrip("/") + "/audit/"
    return {kv.key: (kv.value, kv.mod_revision) for kv in result.kvs if not kv.key.startswith(audit_log)}


async def test_begin_write_commit_then_latest(client: Client, storage_root: Path, clock: ManualClock) -> None:
    ckpt = await client.begin(JOB, step=100, world_size=2, attempt=1, metadata={"code_version": "abc123"})
    assert ckpt.state == pb.CHECKPOINT_STATE_WRITING
    assert ckpt.id.startswith("ckpt-") and ckpt.job_id == JOB and ckpt.step == 100 and ckpt.attempt == 1
    directory = location_dir(ckpt.location)
    assert directory == storage_root / JOB / ckpt.id
    assert directory.is_dir(), "Begin creates the directory workers write into"
    assert ckpt.created_at.ToSeconds() == int(clock.now())

    shards = write_shards(ckpt, dcp_like_files(world_size=2, step=100))
    clock.advance(30)
    committed = await client.commit(ckpt.id, shards)
    assert committed.state == pb.CHECKPOINT_STATE_COMMITTED
    assert committed.committed_at.ToSeconds() == int(clock.now())
    assert committed.total_bytes == sum(s.size_bytes for s in shards)
    assert {(s.path, s.size_bytes, s.checksum, s.rank) for s in committed.shards} == \
        {(s.path, s.size_bytes, s.checksum, s.rank) for s in shards}
    assert dict(committed.metadata) == {"code_version": "abc123"}

    latest = await client.latest(JOB)
    assert latest == committed
    assert await client.get(ckpt.id) == committed


@pytest.mark.parametrize("damage", ["truncate", "delete", "grow"])
async def test_damaged_shard_is_refused_and_nothing_changes(
        client: Client, etcd_store: EtcdStore, key_prefix: str, damage: str) -> None:
    good = await client.save(JOB, step=10)
    ckpt = await client.begin(JOB, step=20)
    shards = write_shards(ckpt, dcp_like_files(world_size=2, step=20))
    victim = location_dir(ckpt.location) / "__1_0.distcp"
    if damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:-5])
    elif damage == "delete":
        victim.unlink()
    else:
        victim.write_bytes(victim.read_bytes() + b"late write")
    before = await snapshot(etcd_store, key_prefix)

    err = await rpc_error(client.commit(ckpt.id, shards))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "'__1_0.distcp'" in (err.details() or "")
    assert {"truncate": "truncated", "delete": "missing", "grow": "declared"}[damage] in (err.details() or "")

    assert await snapshot(etcd_store, key_prefix) == before, "a refused commit writes nothing"
    assert (await client.get(ckpt.id)).state == pb.CHECKPOINT_STATE_WRITING
    assert (await client.latest(JOB)).id == good.id


async def test_commit_with_missing_shards_names_every_one(client: Client, etcd_store: EtcdStore,
                                                          key_prefix: str) -> None:
    good = await client.save(JOB, step=1, world_size=4)
    ckpt = await client.begin(JOB, step=2, world_size=4)
    shards = write_shards(ckpt, dcp_like_files(world_size=4, step=2))
    for name in ("__1_0.distcp", "__3_0.distcp"):
        (location_dir(ckpt.location) / name).unlink()
    before = await snapshot(etcd_store, key_prefix)
    files_before = sorted(p.name for p in location_dir(good.location).iterdir())
    err = await rpc_error(client.commit(ckpt.id, shards))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = err.details() or ""
    assert "'__1_0.distcp' (rank 1) is missing" in details and "'__3_0.distcp' (rank 3) is missing" in details
    assert "'__0_0.distcp'" not in details
    assert await snapshot(etcd_store, key_prefix) == before
    assert sorted(p.name for p in location_dir(good.location).iterdir()) == files_before
    assert (await client.latest(JOB)).id == good.id


async def test_declared_size_larger_than_file_names_the_shard(client: Client) -> None:
    ckpt = await client.begin(JOB, step=1, world_size=1)
    shards = write_shards(ckpt, {"__0_0.distcp": (0, b"x" * 100), ".metadata": (0, b"m")})
    shards[0].size_bytes = 200
    err = await rpc_error(client.commit(ckpt.id, shards))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "'__0_0.distcp' (rank 0) is truncated: 100 bytes in storage, 200 declared" in (err.details() or "")


async def test_commit_is_idempotent_with_the_same_shards(client: Client, clock: ManualClock) -> None:
    ckpt = await client.begin(JOB, step=5)
    shards = write_shards(ckpt, dcp_like_files(world_size=2, step=5))
    first = await client.commit(ckpt.id, shards)
    clock.advance(60)
    again = await client.commit(ckpt.id, list(reversed(shards)))
    assert again == first, "a repeated commit returns the checkpoint as committed the first time"

    different = [*shards[:-1], pb.ShardInfo(path="extra.bin", size_bytes=0, checksum="xxh3:" + "0" * 16)]
    err = await rpc_error(client.commit(ckpt.id, different))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "different shard list" in (err.details() or "")


async def test_abort_is_idempotent_and_final(client: Client) -> None:
    ckpt = await client.begin(JOB, step=7)
    shards = write_shards(ckpt, dcp_like_files(world_size=2, step=7))
    aborted = await client.abort(ckpt.id, reason="rank 1 died")
    assert aborted.state == pb.CHECKPOINT_STATE_ABORTED
    assert await client.abort(ckpt.id, reason="again") == aborted
    assert location_dir(ckpt.location).is_dir(), "abort leaves files alone (workers may still write)"

    err = await rpc_error(client.commit(ckpt.id, shards))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "ABORTED" in (err.details() or "") and "rank 1 died" in (err.details() or "")
    assert (await rpc_error(client.latest(JOB))).code() == grpc.StatusCode.NOT_FOUND


async def test_abort_after_commit_is_refused(client: Client) -> None:
    committed = await client.save(JOB, step=3)
    err = await rpc_error(client.abort(committed.id))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "COMMITTED" in (err.details() or "")
    assert (await client.get(committed.id)).state == pb.CHECKPOINT_STATE_COMMITTED


async def test_latest_only_moves_forward_in_step(client: Client) -> None:
    at_100 = await client.save(JOB, step=100)
    assert (await client.latest(JOB)).id == at_100.id
    at_200 = await client.save(JOB, step=200)
    assert (await client.latest(JOB)).id == at_200.id

    # A slow save that finishes after a newer one: begun first, committed last.
    slow = await client.begin(JOB, step=300)
    fast = await client.begin(JOB, step=400)
    await client.commit(fast.id, write_shards(fast, dcp_like_files(2, 400)))
    await client.commit(slow.id, write_shards(slow, dcp_like_files(2, 300)))
    assert (await client.latest(JOB)).id == fast.id, "an older step committed late does not move latest back"


@pytest.mark.parametrize("step", [399, 400])
async def test_begin_with_a_step_not_after_latest_is_refused(client: Client, etcd_store: EtcdStore,
                                                             key_prefix: str, storage_root: Path, step: int) -> None:
    latest = await client.save(JOB, step=400)
    before = await snapshot(etcd_store, key_prefix)
    dirs_before = sorted(p.name for p in (storage_root / JOB).iterdir())
    err = await rpc_error(client.begin(JOB, step=step))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"step {step} is not after step 400" in (err.details() or "") and latest.id in (err.details() or "")
    assert await snapshot(etcd_store, key_prefix) == before
    assert sorted(p.name for p in (storage_root / JOB).iterdir()) == dirs_before
    assert (await client.begin(JOB, step=401)).state == pb.CHECKPOINT_STATE_WRITING


async def test_latest_is_per_job(client: Client) -> None:
    a = await client.save("job-a", step=1)
    b = await client.save("job-b", step=1)
    assert (await client.latest("job-a")).id == a.id
    assert (await client.latest("job-b")).id == b.id
    err = await rpc_error(client.latest("job-c"))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert "job-c has no committed checkpoint" in (err.details() or "")


async def test_list_pages_in_creation_order(client: Client, clock: ManualClock) -> None:
    ids = []
    for step in (30, 10, 20, 50, 40):  # creation order differs from step order
        ids.append((await client.begin(JOB, step=step)).id)
        clock.advance(1)
    await client.save("job-other", step=1)

    seen: list[str] = []
    token = ""
    pages = 0
    while True:
        resp = await client.stub.ListCheckpoints(pb.ListCheckpointsRequest(job_id=JOB, page_size=2,
                                                                           page_token=token))
        pages += 1
        assert len(resp.checkpoints) <= 2
        seen.extend(c.id for c in resp.checkpoints)
        token = resp.next_page_token
        if not token:
            break
    assert seen == ids
    assert pages == 3

    everything = await client.stub.ListCheckpoints(pb.ListCheckpointsRequest(job_id=JOB))
    assert [c.id for c in everything.checkpoints] == ids and everything.next_page_token == ""
    empty = await client.stub.ListCheckpoints(pb.ListCheckpointsRequest(job_id="job-none"))
    assert list(empty.checkpoints) == [] and empty.next_page_token == ""


async def test_delete_refuses_latest_and_removes_files(client: Client) -> None:
    old = await client.save(JOB, step=1)
    new = await client.save(JOB, step=2)
    err = await rpc_error(client.delete(new.id))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "latest" in (err.details() or "")
    assert (await client.get(new.id)).state == pb.CHECKPOINT_STATE_COMMITTED
    assert location_dir(new.location).is_dir()

    await client.delete(old.id)
    gone = await client.get(old.id)
    assert gone.state == pb.CHECKPOINT_STATE_DELETED
    assert not location_dir(old.location).exists()
    await client.delete(old.id)  # idempotent
    assert (await client.latest(JOB)).id == new.id


async def test_delete_of_writing_is_refused_and_of_aborted_removes_files(client: Client) -> None:
    writing = await client.begin(JOB, step=1)
    write_shards(writing, dcp_like_files(2, 1))
    err = await rpc_error(client.delete(writing.id))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "abort it first" in (err.details() or "")
    assert location_dir(writing.location).is_dir()

    await client.abort(writing.id, "gave up")
    await client.delete(writing.id)
    assert (await client.get(writing.id)).state == pb.CHECKPOINT_STATE_DELETED
    assert not location_dir(writing.location).exists()
    # Abort stays idempotent for a checkpoint deleted after it was aborted.
    assert (await client.abort(writing.id)).state == pb.CHECKPOINT_STATE_DELETED


async def test_unknown_ids_are_not_found(client: Client) -> None:
    unknown = new_id("ckpt")
    calls = {
        "get": client.get(unknown),
        "commit": client.commit(unknown, [pb.ShardInfo(path="a", size_bytes=1, checksum="crc32c:00000000")]),
        "abort": client.abort(unknown),
        "delete": client.delete(unknown),
        "latest": client.latest("job-without-checkpoints"),
    }
    for name, call in calls.items():
        err = await rpc_error(call)
        assert err.code() == grpc.StatusCode.NOT_FOUND, name
        assert ("not found" in (err.details() or "")) or ("no committed checkpoint" in (err.details() or "")), name


BAD_BEGINS = [
    (dict(job_id="", step=1, world_size=1), "job_id is required"),
    (dict(job_id="Job_With_Caps", step=1, world_size=1), "not a valid job id"),
    (dict(job_id="job-x/../y", step=1, world_size=1), "not a valid job id"),
    (dict(job_id="job-x", step=-1, world_size=1), "step must be >= 0"),
    (dict(job_id="job-x", step=1, world_size=0), "world_size must be >= 1"),
    (dict(job_id="job-x", step=1, world_size=1, attempt=-1), "attempt must be >= 0"),
    (dict(job_id="job-x", step=1, world_size=1, metadata={"": "v"}), "metadata key"),
    (dict(job_id="job-x", step=1, world_size=1, lineage=pb.Lineage(job_spec="{not json")),
     "lineage.job_spec is not valid JSON"),
    (dict(job_id="job-x", step=1, world_size=1, lineage=pb.Lineage(job_spec="[1, 2]")),
     "lineage.job_spec must be a JSON object"),
    (dict(job_id="job-x", step=1, world_size=1, lineage=pb.Lineage(job_spec='{"a": "' + "x" * 70_000 + '"}')),
     "lineage.job_spec is 70009 bytes; at most 65536"),
    (dict(job_id="job-x", step=1, world_size=1, lineage=pb.Lineage(code_version="abc\ndef")),
     "lineage.code_version"),
    (dict(job_id="job-x", step=1, world_size=1, lineage=pb.Lineage(parameters={"": "1"})),
     "lineage.parameters key"),
    (dict(job_id="job-x", step=1, world_size=1, retention=pb.RetentionPolicy()), "retention keeps nothing"),
]


@pytest.mark.parametrize(("fields", "message"), BAD_BEGINS, ids=[m for _, m in BAD_BEGINS])
async def test_bad_begin_is_invalid_argument(client: Client, etcd_store: EtcdStore, key_prefix: str,
                                             storage_root: Path, fields: dict[str, object], message: str) -> None:
    err = await rpc_error(client.stub.BeginCheckpoint(pb.BeginCheckpointRequest(**fields)))  # type: ignore[arg-type]
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (err.details() or "")
    assert await snapshot(etcd_store, key_prefix) == {}
    assert not any(storage_root.iterdir())  # noqa: ASYNC240 - a listing of an empty test directory


def _shard(path: str = "__0_0.distcp", size: int = 1, checksum: str = checksum_of(b"x"),
           rank: int = 0) -> pb.ShardInfo:
    return pb.ShardInfo(path=path, size_bytes=size, checksum=checksum, rank=rank)


BAD_COMMITS = [
    ([], "shards is empty"),
    ([_shard(path="../escape")], "contains '..'"),
    ([_shard(path="a/../../b")], "contains '..'"),
    ([_shard(path="/etc/passwd")], "is absolute"),
    ([_shard(path="a//b")], "canonical form"),
    ([_shard(path="./a")], "canonical form"),
    ([_shard(path="a\\b")], "backslash"),
    ([_shard(path="")], "is empty"),
    ([_shard(size=-1)], "size_bytes of '__0_0.distcp' must be >= 0"),
    ([_shard(rank=2)], "rank of '__0_0.distcp' must be in [0, 2)"),
    ([_shard(rank=-1)], "must be in [0, 2)"),
    ([_shard(checksum="md5:0123")], "checksum of '__0_0.distcp'"),
    ([_shard(checksum="crc32c:0BADF00D")], "lower-case hex"),
    ([_shard(checksum="crc32c:0badf00d")], "crc32c, which this service cannot verify"),
    ([_shard(checksum="xxh3c:0:0123456789abcdef")], "xxh3c:<chunk bytes>"),
    ([_shard(path=".trainyard-manifest.json")], "reserved prefix"),
    ([_shard(path="sub/.trainyard-x")], "reserved prefix"),
    ([_shard(path="a\x00b")], "control character"),
    ([_shard(checksum="xxh3:0123")], "checksum"),
    ([_shard(checksum="")], "checksum"),
    ([_shard(), _shard(rank=1)], "declared twice"),
]


@pytest.mark.parametrize(("shards", "message"), BAD_COMMITS, ids=[m for _, m in BAD_COMMITS])
async def test_bad_commit_is_invalid_argument(client: Client, shards: list[pb.ShardInfo], message: str) -> None:
    ckpt = await client.begin(JOB, step=1, world_size=2)
    err = await rpc_error(client.commit(ckpt.id, shards))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (err.details() or "")
    assert (await client.get(ckpt.id)).state == pb.CHECKPOINT_STATE_WRITING


@pytest.mark.parametrize("bad_id", ["", "nope", "CKPT-123", "ckpt-../x", "job-123456"])
async def test_malformed_checkpoint_id_is_invalid_argument(client: Client, bad_id: str) -> None:
    for call in (client.get(bad_id), client.abort(bad_id), client.delete(bad_id), client.commit(bad_id, [_shard()])):
        err = await rpc_error(call)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "checkpoint_id" in (err.details() or "")


async def test_bad_list_requests_are_invalid_argument(client: Client) -> None:
    cases = [
        (pb.ListCheckpointsRequest(job_id=""), "job_id is required"),
        (pb.ListCheckpointsRequest(job_id=JOB, page_size=-1), "page_size must be >= 0"),
        (pb.ListCheckpointsRequest(job_id=JOB, page_token="garbage"), "page_token"),
    ]
    for request, message in cases:
        err = await rpc_error(client.stub.ListCheckpoints(request))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, message
        assert message in (err.details() or "")


async def test_health_service_reports_serving(app: CheckpointApp) -> None:

    async with insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        resp = await health.Check(health_pb2.HealthCheckRequest(
            service="trainyard.checkpoint.v1.CheckpointService"))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


async def test_shard_that_is_a_link_outside_or_a_directory_is_refused(client: Client, tmp_path: Path) -> None:
    ckpt = await client.begin(JOB, step=1, world_size=1)
    directory = location_dir(ckpt.location)
    (tmp_path / "elsewhere").write_bytes(b"12345")
    (directory / "escape").symlink_to(tmp_path / "elsewhere")
    (directory / "adir").mkdir()
    for path, message in (("escape", "leads outside"), ("adir", "not a regular file")):
        err = await rpc_error(client.commit(ckpt.id, [_shard(path=path, size=5)]))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, path
        assert message in (err.details() or "")
    assert (await client.get(ckpt.id)).state == pb.CHECKPOINT_STATE_WRITING


async def test_store_outage_is_unavailable_not_internal(settings: CheckpointSettings) -> None:
    store = MemoryStore()
    app = CheckpointApp(settings, store=store)
    await app.start()
    try:
        async with insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
            client = Client(pb_grpc.CheckpointServiceStub(channel))
            saved = await client.save(JOB, step=1)
            store.available = False
            for call in (client.begin(JOB, step=2), client.get(saved.id), client.latest(JOB)):
                err = await rpc_error(call)
                assert err.code() == grpc.StatusCode.UNAVAILABLE
                assert "unavailable" in (err.details() or "")
            store.available = True
            assert (await client.latest(JOB)).id == saved.id
    finally:
        await app.stop()
