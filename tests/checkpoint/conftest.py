"""Checkpoint-store fixtures: the real app (real etcd, real gRPC server on port 0) and a client; a real
`moto_server` process on 127.0.0.1 for S3."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from trainyard.checkpoint.v1 import checkpoint_pb2_grpc as pb_grpc
from trainyard_checkpoint.app import CheckpointApp
from trainyard_checkpoint.settings import CheckpointSettings
from trainyard_core.clock import ManualClock
from trainyard_core.rpc.server import insecure_channel
from trainyard_core.testing.etcd import free_port
from trainyard_core.testing.wait import eventually

from .checkpoint_support import Client


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def storage_root(tmp_path: Path) -> Path:
    return tmp_path / "checkpoints"


@pytest.fixture
def settings(storage_root: Path, etcd_settings: dict[str, str], key_prefix: str) -> CheckpointSettings:
    # No background GC: tests run passes through RunGc, with the clock where they want it.
    return CheckpointSettings(listen_host="127.0.0.1", listen_port=0, storage_url=storage_root.as_uri(),
                              **etcd_settings, etcd_prefix=key_prefix.rstrip("/"),
                              shutdown_grace_s=1.0, gc_interval_s=0)


# -- S3 ---------------------------------------------------------------------------------------------
S3_KEY = "trainyard-test-key"
S3_SECRET = "trainyard-test-secret-do-not-log"
S3_REGION = "us-east-1"


@dataclass(frozen=True)
class MotoServer:
    endpoint: str


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """A real S3 API: moto's standalone server, one per test session, on a free loopback port."""
    exe = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or shutil.which("moto_server")
    if exe is None:
        raise RuntimeError("moto_server is not installed: pip install 'moto[server]' (make deps does)")
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log_path = tmp_path_factory.mktemp("moto") / "moto.log"
    env = {**os.environ, "AWS_DEFAULT_REGION": S3_REGION}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                env=env)

    async def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"moto_server exited with {proc.returncode}: {log_path.read_text()}")
        try:
            await asyncio.to_thread(urllib.request.urlopen, endpoint + "/moto-api/", None, 0.5)
        except OSError:
            return False
        return True

    try:
        asyncio.run(eventually(up, timeout=60, what="moto_server to answer"))
        yield MotoServer(endpoint)
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # botocore takes the region from the environment; nothing must reach for real AWS credentials.
    monkeypatch.setenv("AWS_DEFAULT_REGION", S3_REGION)
    for name in ("AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def s3fs_client(moto_server: MotoServer, s3_env: None) -> Any:
    """A worker's view of the bucket: plain s3fs with the same endpoint and credentials."""
    import s3fs

    return s3fs.S3FileSystem(key=S3_KEY, secret=S3_SECRET, endpoint_url=moto_server.endpoint,
                             skip_instance_cache=True, use_listings_cache=False)


@pytest.fixture
def s3_bucket(s3fs_client: Any) -> str:
    """A fresh bucket per test."""
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    s3fs_client.mkdir(name)
    return name


@pytest.fixture
def s3_settings(moto_server: MotoServer, s3_bucket: str, etcd_settings: dict[str, str],
                key_prefix: str) -> CheckpointSettings:
    return CheckpointSettings(
        listen_host="127.0.0.1", listen_port=0, storage_url=f"s3://{s3_bucket}/checkpoints",
        s3_endpoint_url=moto_server.endpoint, s3_access_key_id=S3_KEY,
        s3_secret_access_key=S3_SECRET,
        **etcd_settings, etcd_prefix=key_prefix.rstrip("/"), shutdown_grace_s=1.0, gc_interval_s=0)


@contextlib.asynccontextmanager
async def running_app(settings: CheckpointSettings, clock: ManualClock) -> AsyncIterator[CheckpointApp]:
    app = CheckpointApp(settings, clock=clock)
    await app.start()
    try:
        yield app
    finally:
        await app.stop()


@contextlib.asynccontextmanager
async def client_of(app: CheckpointApp) -> AsyncIterator[Client]:
    channel = insecure_channel(f"127.0.0.1:{app.grpc_port}")
    try:
        yield Client(pb_grpc.CheckpointServiceStub(channel))
    finally:
        await channel.close()


@pytest.fixture
async def s3_app(s3_settings: CheckpointSettings, clock: ManualClock) -> AsyncIterator[CheckpointApp]:
    async with running_app(s3_settings, clock) as app:
        yield app


@pytest.fixture
async def s3_client(s3_app: CheckpointApp) -> AsyncIterator[Client]:
    async with client_of(s3_app) as client:
        yield client


@pytest.fixture
async def app(settings: CheckpointSettings, clock: ManualClock) -> AsyncIterator[CheckpointApp]:
    async with running_app(settings, clock) as app:
        yield app


@pytest.fixture
async def client(app: CheckpointApp) -> AsyncIterator[Client]:
    async with client_of(app) as client:
        yield client
