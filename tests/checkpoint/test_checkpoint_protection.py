"""What protects a committed checkpoint from Delete and GC: tags and restore leases (which expire)."""

from __future__ import annotations

import grpc
import pytest

from trainyard.checkpoint.v1 import checkpoint_pb2 as pb
from trainyard_core.store.etcd import EtcdStore
from trainyard_core.testing.wait import eventually

from .checkpoint_support import Client, location_dir, rpc_error

JOB = "job-protect"


async def test_tags_are_idempotent_and_block_delete(client: Client) -> None:
    old = await client.save(JOB, step=1)
    await client.save(JOB, step=2)
    tagged = await client.tag(old.id, "best")
    assert list(tagged.tags) == ["best"]
    assert list((await client.tag(old.id, "best")).tags) == ["best"]
    assert list((await client.tag(old.id, "release-1.0")).tags) == ["best", "release-1.0"]

    err = await rpc_error(client.delete(old.id))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "tagged best, release-1.0; untag it" in (err.details() or "")
    assert location_dir(old.location).is_dir()

    await client.untag(old.id, "best")
    assert list((await client.untag(old.id, "release-1.0")).tags) == []
    assert list((await client.untag(old.id, "never-there")).tags) == []
    await client.delete(old.id)
    assert (await client.get(old.id)).state == pb.CHECKPOINT_STATE_DELETED


async def test_bad_tags(client: Client) -> None:
    writing = await client.begin(JOB, step=1)
    err = await rpc_error(client.tag(writing.id, "best"))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "only committed checkpoints" in (err.details() or "")
    done = await client.save(JOB, step=2)
    for bad in ("", "-x", "has space", "a/b", "x" * 64, "ünï"):
        err = await rpc_error(client.tag(done.id, bad))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "tag" in (err.details() or ""), bad
    for i in range(16):
        await client.tag(done.id, f"t{i}")
    err = await rpc_error(client.tag(done.id, "one-too-many"))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "16 tags" in (err.details() or "")


async def test_lease_blocks_delete_until_released(client: Client) -> None:
    old = await client.save(JOB, step=1)
    await client.save(JOB, step=2)
    first = await client.acquire(old.id, ttl_s=600, holder="job-x attempt 2")
    second = await client.acquire(old.id, ttl_s=600)
    assert first != second

    err = await rpc_error(client.delete(old.id))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "being restored (2 active restore lease(s))" in (err.details() or "")

    renewed = await client.stub.RenewRestoreLease(pb.RenewRestoreLeaseRequest(checkpoint_id=old.id, lease_id=first))
    assert 0 < renewed.ttl_s <= 600
    await client.release(old.id, first)
    await client.release(old.id, first)  # idempotent
    err = await rpc_error(client.stub.RenewRestoreLease(pb.RenewRestoreLeaseRequest(checkpoint_id=old.id,
                                                                                     lease_id=first)))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "expired or was released" in (err.details() or "")
    assert (await rpc_error(client.delete(old.id))).code() == grpc.StatusCode.FAILED_PRECONDITION

    await client.release(old.id, second)
    await client.delete(old.id)
    assert not location_dir(old.location).exists()


async def test_a_lease_id_only_works_with_its_checkpoint(client: Client) -> None:
    a = await client.save(JOB, step=1)
    b = await client.save(JOB, step=2)
    lease = await client.acquire(a.id)
    await client.release(b.id, lease)  # names the wrong checkpoint: nothing is released
    await client.save(JOB, step=3)
    err = await rpc_error(client.delete(a.id))
    assert "being restored" in (err.details() or "")


async def test_leases_expire(client: Client, etcd_store: EtcdStore, key_prefix: str) -> None:
    old = await client.save(JOB, step=1)
    await client.save(JOB, step=2)
    await client.acquire(old.id, ttl_s=1)
    assert (await rpc_error(client.delete(old.id))).code() == grpc.StatusCode.FAILED_PRECONDITION

    async def expired() -> bool:
        return not (await etcd_store.range(f"{key_prefix}checkpoint-leases/")).kvs

    await eventually(expired, timeout=10, what="the 1 s restore lease to expire in etcd")
    await client.delete(old.id)
    assert (await client.get(old.id)).state == pb.CHECKPOINT_STATE_DELETED


@pytest.mark.parametrize(("request_", "code", "message"), [
    (pb.AcquireRestoreLeaseRequest(checkpoint_id="ckpt-0000000000zzzzzzzz", ttl_s=10), "NOT_FOUND", "not found"),
    (pb.AcquireRestoreLeaseRequest(checkpoint_id="nope", ttl_s=10), "INVALID_ARGUMENT", "checkpoint_id"),
    (pb.AcquireRestoreLeaseRequest(checkpoint_id="ckpt-0000000000zzzzzzzz", ttl_s=0), "INVALID_ARGUMENT",
     "ttl_s must be in [1, 86400]"),
    (pb.AcquireRestoreLeaseRequest(checkpoint_id="ckpt-0000000000zzzzzzzz", ttl_s=86401), "INVALID_ARGUMENT",
     "ttl_s must be in [1, 86400]"),
    (pb.AcquireRestoreLeaseRequest(checkpoint_id="ckpt-0000000000zzzzzzzz", ttl_s=5, holder="a\nb"),
     "INVALID_ARGUMENT", "holder"),
])
async def test_bad_lease_requests(client: Client, request_: pb.AcquireRestoreLeaseRequest, code: str,
                                  message: str) -> None:
    err = await rpc_error(client.stub.AcquireRestoreLease(request_))
    assert err.code() == getattr(grpc.StatusCode, code) and message in (err.details() or "")


async def test_only_committed_checkpoints_are_leased(client: Client) -> None:
    writing = await client.begin(JOB, step=1)
    err = await rpc_error(client.acquire(writing.id))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "it is WRITING" in (err.details() or "")
    done = await client.save(JOB, step=2)
    for bad in ("", "xyz", "-1", "0x10", "1" * 17):
        err = await rpc_error(client.release(done.id, bad))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "lease_id" in (err.details() or ""), bad
