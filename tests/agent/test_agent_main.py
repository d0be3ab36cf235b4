"""`trainyard-agent` as a real process: refuses to start without NVML unless simulating, writes the ready
file, registers, serves, and on SIGTERM stops (killing its workers when told to)."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

import grpc.aio

from tests.agent.agent_kit import until
from tests.agent.conftest import Scheduler
from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard_agent.workers import process

PY = sys.executable


async def test_without_nvml_the_agent_explains_how_to_simulate(tmp_path: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        PY, "-m", "trainyard_agent.main", "--state-dir", str(tmp_path), "--log-format", "text",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 1
    text = err.decode()
    assert "NVML is not available" in text and "NVMLError_LibraryNotFound" in text
    assert "--gpu-profile" in text


async def test_a_refused_registration_ends_the_process_with_code_3(tmp_path: Path, scheduler: Scheduler) -> None:
    scheduler.service.refuse = "node id is reserved"
    proc = await asyncio.create_subprocess_exec(
        PY, "-m", "trainyard_agent.main", "--gpu-profile", "cpu", "--node-id", "node-main",
        "--state-dir", str(tmp_path), "--scheduler-address", scheduler.address, "--log-format", "text",
        stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 3
    assert "refused to register node 'node-main': node id is reserved" in err.decode()


async def test_serves_until_sigterm_and_kills_workers_when_told(tmp_path: Path, scheduler: Scheduler) -> None:
    ready = tmp_path / "ready.json"
    proc = await asyncio.create_subprocess_exec(
        PY, "-m", "trainyard_agent.main", "--gpu-profile", "a100x4", "--node-id", "node-main",
        "--state-dir", str(tmp_path / "state"), "--ready-file", str(ready), "--kill-workers-on-stop",
        "--scheduler-address", scheduler.address, "--stop-grace-s", "2", "--heartbeat-interval-s", "0.2",
        stderr=asyncio.subprocess.DEVNULL)
    try:
        await until(ready.exists, "the ready file", timeout=60)
        port = json.loads(ready.read_text())["grpc_port"]
        await until(lambda: scheduler.service.registers, "the agent to register")
        assert scheduler.service.registers[0].node.agent_address == f"127.0.0.1:{port}"
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            launched = await stub.LaunchWorkers(agent_pb2.LaunchWorkersRequest(
                job_id="job-main", attempt=1, command=[PY, "-c", "import time; time.sleep(300)"], leader_epoch=1,
                workers=[agent_pb2.WorkerSpec(rank=0, gpu_indices=[0])]))
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), timeout=30) == 0
        assert process.start_time(launched.pids[0]) is None, "the worker outlived the agent"
        assert [(e.job_id, e.exit.signal) for e in scheduler.service.exits] == [("job-main", 15)]
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
