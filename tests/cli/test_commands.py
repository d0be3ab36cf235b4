"""The CLI against a real gateway, with a real scheduler behind it and, where jobs must run, real agents on
simulated GPUs: output, --json, exit codes, error messages."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.gateway.support import Cluster, RunningGateway, python, wait_for_file
from trainyard.common.v1 import types_pb2
from trainyard_core.testing.etcd import free_port
from trainyard_core.testing.wait import eventually

TRAINYARD = str(Path(sys.executable).parent / "trainyard")
SLEEP = python("import time; time.sleep(120)")


async def test_submit_with_flags(cli: Any, gateway: RunningGateway, scheduler: Cluster) -> None:
    r = await cli("submit", "--name", "hello", "--nodes", "2", "--gpus-per-node", "1", "--env", "LR=0.1",
                  "--", "python", "train.py", "--epochs", "3")
    assert r.rc == 0, r.err
    (job,) = await scheduler.list_jobs()
    assert r.out.startswith(f"submitted job {job.id} (hello, 2x1 GPUs): pending")
    assert list(job.spec.command) == ["python", "train.py", "--epochs", "3"]
    assert (job.spec.resources.nodes, dict(job.spec.env), job.team, job.user) == (2, {"LR": "0.1"}, "admin", "admin")


async def test_submit_from_a_spec_file_with_json_output(cli: Any, gateway: RunningGateway, clean_env: Path) -> None:
    (clean_env / "job.yaml").write_text("name: from-file\ncommand: [python, t.py]\n"
                                        "resources: {nodes: 1, gpus_per_node: 2}\nenv: {THREADS: 4}\n")
    r = await cli("submit", "-f", "job.yaml", "--json")
    assert r.rc == 0, r.err
    job = json.loads(r.out)
    assert (job["name"], job["spec"]["env"], job["spec"]["resources"]["gpus_per_node"]) == (
        "from-file", {"THREADS": "4"}, 2)


async def test_api_refusals_are_one_line_errors(cli: Any, gateway: RunningGateway) -> None:
    r = await cli("submit", "--name", "Bad Name", "--nodes", "0", "--", "true")
    assert r.rc == 1
    assert r.err.startswith("error: name: must be") and "resources.nodes" in r.err
    assert len(r.err.strip().splitlines()) == 1
    r = await cli("status", "job-does-not-exist")
    assert (r.rc, r.err.strip()) == (1, "error: job job-does-not-exist not found")
    r = await cli("jobs", "--token", "ty_" + "z" * 40)
    assert r.rc == 1 and r.err.strip() == "error: invalid or revoked token (token from --token)"


async def test_unreachable_gateway(cli: Any) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    r = await cli("jobs", "--url", url, "--token", "ty_x")
    assert r.rc == 1
    assert r.err.strip() == f"error: cannot reach the gateway at {url}: connection refused — is `make run` running?"


def test_no_traceback_from_the_installed_command(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")}
    env["TRAINYARD_URL"] = f"http://127.0.0.1:{free_port()}"
    env["TRAINYARD_TOKEN"] = "ty_x"
    proc = subprocess.run([TRAINYARD, "nodes"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: cannot reach the gateway") and "Traceback" not in proc.stderr


async def test_local_env_file_is_used(cli: Any, gateway: RunningGateway, clean_env: Path,
                                      monkeypatch: Any) -> None:
    monkeypatch.delenv("TRAINYARD_URL")
    monkeypatch.delenv("TRAINYARD_TOKEN")
    (clean_env / ".trainyard").mkdir()
    (clean_env / ".trainyard" / "local.env").write_text(
        f"TRAINYARD_URL={gateway.url}\nTRAINYARD_TOKEN={gateway.admin_token}\n")
    sub = clean_env / "project"
    sub.mkdir()
    monkeypatch.chdir(sub)
    r = await cli("nodes")
    assert (r.rc, r.out.strip()) == (0, "no nodes registered")


async def test_jobs_table_and_paging(cli: Any, gateway: RunningGateway, scheduler: Cluster) -> None:
    ids = [(await scheduler.submit(["true"], team="vision", user="alice", name=f"job{i}")).id for i in range(5)]
    r = await cli("jobs", "--page-size", "2")
    assert r.rc == 0
    lines = r.out.splitlines()
    assert lines[0].split() == ["ID", "NAME", "STATE", "GPUS", "TEAM/USER", "AGE"]
    assert [line.split()[0] for line in lines[1:]] == ids[::-1][:2], "newest first"
    assert "--all" in r.err
    r = await cli("jobs", "--page-size", "2", "--all", "--json")
    assert [j["id"] for j in json.loads(r.out)["jobs"]] == ids[::-1]
    r = await cli("jobs", "--state", "running")
    assert r.out.strip() == "no jobs match"


async def test_jobs_filters(cli: Any, gateway: RunningGateway, scheduler: Cluster) -> None:
    await scheduler.submit(["true"], team="vision", user="alice", name="sweep-1")
    bobs = await scheduler.submit(["true"], team="vision", user="bob", name="sweep-2")
    r = await cli("jobs", "--user", "bob", "--name", "sweep-", "--since", "1d", "--json")
    assert r.rc == 0, r.err
    assert [j["id"] for j in json.loads(r.out)["jobs"]] == [bobs.id]
    r = await cli("jobs", "--state", "failed", "--since", "1d", "--until", "2099-01-01T00:00:00Z",
                  "--finished-since", "2h", "--label", "project=atlas", "--queue", "batch")
    assert (r.rc, r.out.strip()) == (0, "no jobs match")
    request = scheduler.calls.requests("ListJobs")[-1]
    assert list(request.states) == [types_pb2.JOB_STATE_FAILED] and dict(request.labels) == {"project": "atlas"}
    assert request.queue == "batch" and request.HasField("submitted_after") and request.HasField("finished_after")
    assert request.submitted_before.seconds == 4070908800  # 2099-01-01T00:00:00Z
    r = await cli("jobs", "--label", "project")
    assert r.rc == 2 and "--label expects KEY=VALUE" in r.err
    r = await cli("jobs", "--since", "yesterday")
    assert r.rc == 2 and "expected a duration like 1h or 2d" in r.err


async def test_status_cancel_and_watch(cli: Any, gateway: RunningGateway, scheduler: Cluster) -> None:
    # No node yet: the job waits, pending, until one joins; then it runs and exits with 3.
    job = await scheduler.submit(python("import sys; sys.exit(3)"), team="vision", name="watched")
    r = await cli("status", job.id)
    assert r.rc == 0 and f"id:        {job.id}" in r.out and "state:     pending" in r.out

    other = await scheduler.submit(["true"], team="vision")
    r = await cli("cancel", other.id, "--reason", "typo")
    assert (r.rc, r.out.strip()) == (0, f"job {other.id} cancelled")
    assert (await scheduler.job(other.id)).message == "typo"
    r = await cli("status", other.id)
    assert "cancelled by: admin" in r.out  # the local bootstrap token's user

    watch = asyncio.create_task(cli("status", job.id, "--watch", "--interval", "0.05"))

    async def watching() -> bool:
        return any(req.job_id == job.id for req in scheduler.calls.stream_requests("WatchJob"))

    await eventually(watching, what="status --watch to watch the job")
    await scheduler.add_agent("node-a")
    r = await asyncio.wait_for(watch, 30)
    assert r.rc == 1  # ended, but not succeeded
    assert "failed" in r.out and "exit code: 3" in r.out

    r = await cli("cancel", job.id)
    assert r.out.strip() == f"job {job.id} had already ended: failed"


async def test_logs_and_follow(cli: Any, gateway: RunningGateway, scheduler: Cluster, tmp_path: Path) -> None:
    await scheduler.add_agent("node-a")
    late, end = tmp_path / "late", tmp_path / "end"
    job = await scheduler.submit(python("""
        import os
        rank = int(os.environ["RANK"])
        for i in range(3):
            print(f"r{rank} line{i}")
    """, wait_for_file(late), """
        if rank == 0:
            print("r0 late")
    """, wait_for_file(end)), gpus=2, team="vision")
    agent = scheduler.agent_calls["node-a"]

    async def logs() -> str:
        async with gateway.client(gateway.admin_token) as http:
            return (await http.get(f"/v1/jobs/{job.id}/logs")).text

    async def printed(count: int) -> bool:
        return (await logs()).count("\n") == count

    await eventually(lambda: printed(6), what="every rank's first lines")
    r = await cli("logs", job.id, "--tail", "1")
    assert r.out.splitlines() == ["[rank 0] r0 line2", "[rank 1] r1 line2"]

    follow = asyncio.create_task(cli("logs", job.id, "--follow", "--interval", "0.05", "--tail", "2"))

    async def followed() -> bool:  # the tail's start is counted before the agent's stream is opened
        return any(req.job_id == job.id for req in agent.stream_requests("StreamWorkerLogs"))

    await eventually(followed, what="logs --follow to stream")
    late.touch()
    await eventually(lambda: printed(7), what="rank 0's late line")
    end.touch()
    await scheduler.wait_state(job.id, types_pb2.JOB_STATE_SUCCEEDED)
    r = await asyncio.wait_for(follow, 30)
    assert r.rc == 0
    lines = r.out.splitlines()
    assert lines[:4] == ["[rank 0] r0 line1", "[rank 0] r0 line2", "[rank 1] r1 line1", "[rank 1] r1 line2"]
    assert lines[4:] == ["[rank 0] r0 late"]


async def test_nodes_table(cli: Any, gateway: RunningGateway, scheduler: Cluster) -> None:
    await scheduler.add_agent("node-a", "a100x4")
    job = await scheduler.submit(SLEEP, gpus=3)
    await scheduler.wait_state(job.id, types_pb2.JOB_STATE_RUNNING)
    r = await cli("nodes")
    assert r.out.splitlines() == ["NODE    STATE  GPUS FREE/TOTAL  MODEL",
                                  "node-a  ready  1/4              A100-SXM4-40GB"]


async def test_tokens(cli: Any, gateway: RunningGateway) -> None:
    r = await cli("tokens", "create", "--team", "vision", "--user", "alice", "--description", "laptop",
                  "--role", "admin", "--ttl", "7d", "--scope", "tokens:write", "--scope", "nodes:read",
                  "--scope", "tokens:read")
    assert r.rc == 0, r.err
    fields = dict(line.split(":", 1) for line in r.out.splitlines())
    secret, token_id = fields["secret"].strip(), fields["token id"].strip()
    assert secret.startswith("ty_") and "shown only now" in r.err
    assert fields["role"].strip() == "admin (scopes nodes:read, tokens:read, tokens:write)"
    assert fields["expires"].strip()[:4].isdigit()  # a local time, seven days on

    r = await cli("nodes", "--token", secret)
    assert r.rc == 0
    r = await cli("tokens", "list", "--team", "vision")
    header, row = r.out.splitlines()
    assert header.split()[:6] == ["TOKEN", "ID", "TEAM", "USER", "ROLE", "SCOPES"]
    assert row.split()[:5] == [token_id, "vision", "alice", "admin", "nodes:read,tokens:read,tokens:write"]
    assert "laptop" in r.out and secret not in r.out
    r = await cli("tokens", "create", "--team", "x", "--user", "y", "--token", secret)
    assert r.rc == 1 and "only for its own team (vision)" in r.err
    r = await cli("tokens", "create", "--team", "vision", "--user", "y", "--role", "operator", "--token", secret)
    assert r.rc == 1 and "up to admin" in r.err
    r = await cli("jobs", "--token", secret)
    assert r.rc == 1 and "jobs.read needs the scope jobs:read" in r.err
    r = await cli("tokens", "revoke", token_id)
    assert r.out.strip() == f"revoked token {token_id} (vision/alice)"
    r = await cli("nodes", "--token", secret)
    assert r.rc == 1 and "invalid or revoked token" in r.err
