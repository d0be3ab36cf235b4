"""Builders for checkpoint tests: play the training workers (write shard files where Begin said) and
drive the service through a real gRPC stub."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import grpc
import grpc.aio

from trainyard.checkpoint.v1 import checkpoint_pb2 as pb
from trainyard.checkpoint.v1 import checkpoint_pb2_grpc as pb_grpc


def checksum_of(data: bytes) -> str:
    """A well-formed checksum string. Not a real crc32c: the service records checksums as declared and
    does not read shard contents (verification belongs to the client library of issue 5)."""
    return "crc32c:" + hashlib.sha256(data).hexdigest()[:8]


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
                    metadata: dict[str, str] | None = None) -> pb.Checkpoint:
        resp = await self.stub.BeginCheckpoint(pb.BeginCheckpointRequest(
            job_id=job_id, step=step, world_size=world_size, attempt=attempt, metadata=metadata or {}))
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


async def rpc_error(call: object) -> grpc.aio.AioRpcError:
    """Await `call` and return the AioRpcError it must fail with."""
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as e:
        return e
    raise AssertionError("the call succeeded; an error was expected")
