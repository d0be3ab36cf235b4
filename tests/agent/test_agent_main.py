"""`trainyard-agent` as a real process against the real scheduler: refuses to start without NVML unless
simulating, writes the ready file, registers, serves, and on SIGTERM stops (killing its workers when told to)."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import textwrap
from pathlib import Path

import grpc.aio

from tests.agent.agent_kit import Scheduler, until
from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard.common.v1 import types_pb2
from trainyard_agent.workers import process

PY = sys.executable

# `trainyard-agent` with its settings' node-id check switched off.
SKEWED_AGENT = textwrap.dedent("""
    import sys
    from pydantic import field_validator
    from trainyard_agent import main

    class SkewedSettings(main.AgentSettings):
        @field_validator("node_id")
        @classmethod
        def _check_node_id(cls, v: str) -> str:
            return v

    main.AgentSettings = SkewedSettings
    sys.exit(main.main())
""")


async def test_without_nvml_the_agent_explains_how_to_simulate(tmp_path: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        PY, "-m", "trainyard_agent.main", "--state-dir", str(tmp_path), "--log-format", "text", "--insecure-plaintext",
        "--single-tenant", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 1
    text = err.decode()
    assert "NVML is not available" in text and "NVMLError_LibraryNotFound" in text
    assert "--gpu-profile" in text


async def test_a_refused_registration_ends_the_process_with_code_3(tmp_path: Path, scheduler: Scheduler) -> None:
    # The agent checks node ids by the scheduler's own rule, so it never sends one the scheduler refuses; this
    # agent's check is switched off (standing in for version skew) so that the real scheduler refuses it.
    script = tmp_path / "skewed_agent.py"
    script.write_text(SKEWED_AGENT)
    proc = await asyncio.create_subprocess_exec(
        PY, str(script), "--gpu-profile", "cpu", "--node-id", "Node-Main", "--insecure-plaintext",
        "--single-tenant", "--state-dir", str(tmp_path / "state"), "--scheduler-address", scheduler.address,
        "--log-format", "text",
        stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 3
    assert "refused to register node 'Node-Main': node_id 'Node-Main' must be 3-63 lower-case" in err.decode()


async def test_serves_until_sigterm_and_kills_workers_when_told(tmp_path: Path, scheduler: Scheduler) -> None:
    ready = tmp_path / "ready.json"
    proc = await asyncio.create_subprocess_exec(
        PY, "-m", "trainyard_agent.main", "--gpu-profile", "a100x4", "--node-id", "node-main", "--insecure-plaintext",
        "--single-tenant", "--state-dir", str(tmp_path / "state"), "--ready-file", str(ready), "--kill-workers-on-stop",
        "--scheduler-address", scheduler.address, "--stop-grace-s", "2", "--heartbeat-interval-s", "0.2",
        stderr=asyncio.subprocess.DEVNULL)
    try:
        await until(ready.exists, "the ready file", timeout=60)
        port = json.loads(ready.read_text())["grpc_port"]
        node = await scheduler.registered("node-main")
        assert node.agent_address == f"127.0.0.1:{port}"
        job_id = await scheduler.submit([PY, "-c", "import time; time.sleep(300)"])
        await scheduler.job_in(job_id, types_pb2.JOB_STATE_RUNNING)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            listed = await agent_pb2_grpc.AgentServiceStub(channel).ListWorkers(agent_pb2.ListWorkersRequest())
        assert [(w.job_id, w.running) for w in listed.workers] == [(job_id, True)]
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), timeout=30) == 0
        assert process.start_time(listed.workers[0].pid) is None, "the worker outlived the agent"
        # The exit reached the scheduler before the agent exited, as the agent's shutdown's doing: the job is
        # restarted as after a lost node, not failed.
        found = await scheduler.repo.get_job(job_id)
        assert found is not None
        job = found[0]
        # (Restarting, or already placed again: the leader has not yet lost the node whose agent just went.)
        assert not job.state.terminal and (job.infra_restarts, job.restarts) == (1, 0), job
        assert [a.reason for a in job.attempts] == [
            "rank 0 on node-main was stopped by its node's agent shutting down"], job.attempts
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
