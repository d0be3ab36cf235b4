"""Builders for checkpoint tests: play the training workers (write shard files where Begin said) and
drive the service through a real gRPC stub."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import grpc
import grpc.aio

from trainyard.checkpoint.v1 import checkpoint_pb2 as pb
from trainyard.checkpoint.v1 import checkpoint_pb2_grpc as pb_grpc
from trainyard_checkpoint import checksum

# Small chunks, so that test shards of a few dozen bytes have several and a mismatch names one.
TEST_CHUNK_BYTES = 16


def checksum_of(data: bytes) -> str:
    """The per-chunk XXH3 checksum a worker declares (the service reads the shard and checks it)."""
    return str(checksum.of_bytes(data, TEST_CHUNK_BYTES))


def location_dir(location: str) -> Path:
    parts = urlsplit(location)
    assert parts.scheme == "file", location
    return Path(unquote(parts.path))


def write_shards(ckpt: pb.Checkpoint, files: dict[str, tuple[int, bytes]]) -> list[pb.ShardInfo]:
    """Write `{path: (rank, data)}` under the checkpoint's location, as workers would; return the
    ShardInfo list a commit declares."""
    base = location_dir(ckpt.location)
    shards = []
    for path, (rank, data) in files.items():
        target = base / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        shards.append(pb.ShardInfo(path=path, size_bytes=len(data), checksum=checksum_of(data), rank=rank))
    return shards


def dcp_like_files(world_size: int, step: int, size: int = 64) -> dict[str, tuple[int, bytes]]:
    """One `.distcp` file per rank plus rank 0's `.metadata`, named as torch.distributed.checkpoint does."""
    files = {f"__{rank}_0.distcp": (rank, bytes([rank % 256]) * size + step.to_bytes(8, "little"))
             for rank in range(world_size)}
    files[".metadata"] = (0, f"metadata of step {step}".encode())
    return files


@dataclass
class Client:
    stub: pb_grpc.CheckpointServiceAsyncStub

    async def begin(self, job_id: str, step: int, world_size: int = 2, attempt: int = 0,
                    metadata: dict[str, str] | None = None, lineage: pb.Lineage | None = None,
                    retention: pb.RetentionPolicy | None = None) -> pb.Checkpoint:
        resp = await self.stub.BeginCheckpoint(pb.BeginCheckpointRequest(
            job_id=job_id, step=step, world_size=world_size, attempt=attempt, metadata=metadata or {},
            lineage=lineage, retention=retention))
        return resp.checkpoint

    async def commit(self, checkpoint_id: str, shards: list[pb.ShardInfo]) -> pb.Checkpoint:
        resp = await self.stub.CommitCheckpoint(pb.CommitCheckpointRequest(checkpoint_id=checkpoint_id,
                                                                           shards=shards))
        return resp.checkpoint

    async def save(self, job_id: str, step: int, world_size: int = 2) -> pb.Checkpoint:
        """Begin, write every rank's shard, commit: a whole successful save."""
        ckpt = await self.begin(job_id, step, world_size)
        return await self.commit(ckpt.id, write_shards(ckpt, dcp_like_files(world_size, step)))

    async def get(self, checkpoint_id: str) -> pb.Checkpoint:
        resp = await self.stub.GetCheckpoint(pb.GetCheckpointRequest(checkpoint_id=checkpoint_id))
        return resp.checkpoint

    async def latest(self, job_id: str) -> pb.Checkpoint:
        resp = await self.stub.GetLatestCheckpoint(pb.GetLatestCheckpointRequest(job_id=job_id))
        return resp.checkpoint

    async def abort(self, checkpoint_id: str, reason: str = "") -> pb.Checkpoint:
        resp = await self.stub.AbortCheckpoint(pb.AbortCheckpointRequest(checkpoint_id=checkpoint_id,
                                                                         reason=reason))
        return resp.checkpoint

    async def delete(self, checkpoint_id: str) -> None:
        await self.stub.DeleteCheckpoint(pb.DeleteCheckpointRequest(checkpoint_id=checkpoint_id))

    async def tag(self, checkpoint_id: str, tag: str) -> pb.Checkpoint:
        resp = await self.stub.TagCheckpoint(pb.TagCheckpointRequest(checkpoint_id=checkpoint_id, tag=tag))
        return resp.checkpoint

    async def untag(self, checkpoint_id: str, tag: str) -> pb.Checkpoint:
        resp = await self.stub.UntagCheckpoint(pb.UntagCheckpointRequest(checkpoint_id=checkpoint_id, tag=tag))
        return resp.checkpoint

    async def set_retention(self, job_id: str, keep_last: int = 0, keep_every_steps: int = 0) -> None:
        await self.stub.SetRetention(pb.SetRetentionRequest(
            job_id=job_id, policy=pb.RetentionPolicy(keep_last=keep_last, keep_every_steps=keep_every_steps)))

    async def acquire(self, checkpoint_id: str, ttl_s: int = 60, holder: str = "test") -> str:
        resp = await self.stub.AcquireRestoreLease(pb.AcquireRestoreLeaseRequest(
            checkpoint_id=checkpoint_id, ttl_s=ttl_s, holder=holder))
        return resp.lease_id

    async def release(self, checkpoint_id: str, lease_id: str) -> None:
        await self.stub.ReleaseRestoreLease(pb.ReleaseRestoreLeaseRequest(checkpoint_id=checkpoint_id,
                                                                          lease_id=lease_id))

    async def gc(self, dry_run: bool = False) -> list[pb.GcAction]:
        resp = await self.stub.RunGc(pb.RunGcRequest(dry_run=dry_run))
        return list(resp.actions)


async def rpc_error(call: object) -> grpc.aio.AioRpcError:
    """Await `call` and return the AioRpcError it must fail with."""
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as e:
        return e
    raise AssertionError("the call succeeded; an error was expected")
