"""The real `trainyard-checkpoint-store` process, as `make run` starts it: settings from the environment,
ready file once serving, a working API, clean exit on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from trainyard.checkpoint.v1 import checkpoint_pb2 as pb
from trainyard.checkpoint.v1 import checkpoint_pb2_grpc as pb_grpc
from trainyard_core.rpc.server import insecure_channel
from trainyard_core.testing.etcd_secure import as_env
from trainyard_core.testing.wait import eventually

from .checkpoint_support import Client, location_dir


@pytest.fixture
def process_env(tmp_path: Path, etcd_settings: dict[str, str], key_prefix: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")}
    env.update({
        **as_env(etcd_settings, "TRAINYARD_CHECKPOINT_STORE_"),
        "TRAINYARD_CHECKPOINT_STORE_ETCD_PREFIX": key_prefix.rstrip("/"),
        "TRAINYARD_CHECKPOINT_STORE_STORAGE_URL": (tmp_path / "checkpoints").as_uri(),
        "TRAINYARD_CHECKPOINT_STORE_READY_FILE": str(tmp_path / "ready.json"),
        "TRAINYARD_CHECKPOINT_STORE_LOG_FORMAT": "text",
        # Workers reach the store without a certificate until per-job worker credentials exist (issue 12).
        "TRAINYARD_CHECKPOINT_STORE_INSECURE_PLAINTEXT": "true",
    })
    return env


@pytest.fixture
def service(process_env: dict[str, str], tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    log = open(tmp_path / "service.log", "wb")  # noqa: SIM115 - closed in teardown
    proc = subprocess.Popen([sys.executable, "-m", "trainyard_checkpoint.main", "--listen-port", "0"],
                            env=process_env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


async def test_process_serves_until_sigterm(service: subprocess.Popen[bytes], tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"

    async def port() -> int | None:
        if service.poll() is not None:
            raise AssertionError(f"the service exited with {service.returncode}:\n"
                                 + (tmp_path / "service.log").read_text())
        return json.loads(ready.read_text())["grpc_port"] if ready.exists() else None

    grpc_port = await eventually(port, timeout=60, what="the checkpoint-store's ready file")
    async with insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(
            service="trainyard.checkpoint.v1.CheckpointService"))
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        client = Client(pb_grpc.CheckpointServiceStub(channel))
        saved = await client.save("job-process", step=1, world_size=1)
        assert saved.state == pb.CHECKPOINT_STATE_COMMITTED
        assert location_dir(saved.location).parent.parent == tmp_path / "checkpoints"

    service.send_signal(signal.SIGTERM)
    code = await asyncio.to_thread(service.wait, 30)
    assert code == 0, (tmp_path / "service.log").read_text()
    assert "stopped" in (tmp_path / "service.log").read_text()


def test_process_with_unusable_storage_exits_with_a_clear_message(process_env: dict[str, str],
                                                                   tmp_path: Path) -> None:
    (tmp_path / "blocker").write_bytes(b"")
    process_env["TRAINYARD_CHECKPOINT_STORE_STORAGE_URL"] = (tmp_path / "blocker" / "root").as_uri()
    done = subprocess.run([sys.executable, "-m", "trainyard_checkpoint.main"], env=process_env,
                          capture_output=True, timeout=60)
    assert done.returncode == 1
    assert b"cannot create checkpoint storage root" in done.stderr
