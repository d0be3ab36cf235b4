"""Checkpoint-store fixtures: the real app (real etcd, real gRPC server on port 0) and a client."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from trainyard.checkpoint.v1 import checkpoint_pb2_grpc as pb_grpc
from trainyard_checkpoint.app import CheckpointApp
from trainyard_checkpoint.settings import CheckpointSettings
from trainyard_core.clock import ManualClock
from trainyard_core.rpc.server import insecure_channel

from .checkpoint_support import Client


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def storage_root(tmp_path: Path) -> Path:
    return tmp_path / "checkpoints"


@pytest.fixture
def settings(storage_root: Path, etcd_endpoint: str, key_prefix: str) -> CheckpointSettings:
    return CheckpointSettings(listen_host="127.0.0.1", listen_port=0, storage_url=storage_root.as_uri(),
                              etcd_endpoints=etcd_endpoint, etcd_prefix=key_prefix.rstrip("/"),
                              shutdown_grace_s=1.0)


@pytest.fixture
async def app(settings: CheckpointSettings, clock: ManualClock) -> AsyncIterator[CheckpointApp]:
    app = CheckpointApp(settings, clock=clock)
    await app.start()
    try:
        yield app
    finally:
        await app.stop()


@pytest.fixture
async def client(app: CheckpointApp) -> AsyncIterator[Client]:
    channel = insecure_channel(f"127.0.0.1:{app.grpc_port}")
    try:
        yield Client(pb_grpc.CheckpointServiceStub(channel))
    finally:
        await channel.close()
