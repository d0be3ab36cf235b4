"""A node dies under a running 2-node training job: the scheduler declares it lost, stops the rest of the
gang, restarts the job on the healthy nodes without using its restart budget, and the workers resume from
the latest committed checkpoint, ending with the weights of a run that never stopped. Workers of a node
whose agent died are killed by the worker fence before the job runs again elsewhere.

Real processes throughout (etcd, scheduler, checkpoint-store, gateway, three simulated nodes)."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from trainyard.checkpoint.v1 import checkpoint_pb2 as ckpt_pb
from trainyard.checkpoint.v1 import checkpoint_pb2_grpc as ckpt_grpc
from trainyard_checkpoint.access import TEAM_HEADER
from trainyard_cli.local import LocalCluster
from trainyard_core.security import identity
from trainyard_core.testing.wait import until

from .conftest import Api, local_cluster

pytestmark = pytest.mark.e2e
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_with_checkpoints.py"
NODES = [("node-1", "a100x4"), ("node-2", "a100x4"), ("node-3", "a100x4")]


@pytest.fixture(scope="module")
def cluster3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with local_cluster(tmp_path_factory, "cluster3", nodes=NODES) as c:
        yield c


@pytest.fixture(scope="module")
def api3(cluster3: LocalCluster) -> Iterator[Api]:
    a = Api(cluster3)
    a.wait_nodes_ready(3)
    yield a
    a.http.close()


def _latest_step(cluster: LocalCluster, job: dict[str, Any]) -> int:
    # As the cluster's tool, for the job's team (the store shows a tool only its team's jobs).
    with cluster.sync_channel(cluster.checkpoint_store_address, identity.CHECKPOINT_STORE) as ch:
        try:
            resp = ckpt_grpc.CheckpointServiceStub(ch).GetLatestCheckpoint(
                ckpt_pb.GetLatestCheckpointRequest(job_id=job["id"]), timeout=5,
                metadata=[(TEAM_HEADER, job["team"])])
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return 0
            raise
        return int(resp.checkpoint.step)


def _submit(api: Api, name: str, script: str) -> dict[str, Any]:
    return api.submit({"name": name, "command": ["sh", "-c", script], "max_restarts": 0,
                       "resources": {"nodes": 2, "gpus_per_node": 1}, "checkpoint": {"every_steps": 4}})


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def test_a_job_resumes_on_healthy_nodes_after_one_of_its_nodes_dies(api3: Api, cluster3: LocalCluster,
                                                                    tmp_path: Path) -> None:
    base = f"{shlex.quote(sys.executable)} {shlex.quote(str(EXAMPLE))} --steps 40 --every 4 --sync"
    straight_out, resumed_out = tmp_path / "straight.json", tmp_path / "resumed.json"
    straight = api3.wait(_submit(api3, "straight", f"exec {base} --out {straight_out}")["id"],
                         {"succeeded", "failed"}, timeout=120)
    assert straight["state"] == "succeeded", straight["message"]

    job = _submit(api3, "survivor", f"exec {base} --step-time 0.25 --out {resumed_out}")
    running = api3.wait(job["id"], {"running"}, timeout=60)
    until(lambda: _latest_step(cluster3, job) >= 8, 60, "a checkpoint at step 8 or later")
    # The node of rank 0 (the rendezvous master) dies: agent, shims and workers.
    victim = next(a["node_id"] for a in running["placement"] if a["node_rank"] == 0)
    killed = cluster3.kill_node(victim)
    assert killed, "the victim node ran workers"

    def restarted() -> dict[str, Any] | None:
        j = api3.job(job["id"])
        return j if j["infra_restarts"] == 1 and j["state"] in ("running", "succeeded") else None

    moved = until(restarted, 60, "the job running again on healthy nodes")
    assert victim not in [a["node_id"] for a in moved["placement"]]
    assert moved["restarts"] == 0, "a lost node does not use the job's restart budget (max_restarts=0)"
    events = [e for e in moved["events"] if e["kind"] == "restarting"]
    assert events and f"node {victim} lost contact" in events[-1]["message"], moved["events"]
    node = api3.http.get(f"/v1/nodes/{victim}").json()
    assert node["state"] != "ready", node

    done = api3.wait(job["id"], {"succeeded", "failed"}, timeout=120)
    assert done["state"] == "succeeded", done["message"]
    assert done["attempt"] == 2
    logs = api3.http.get(f"/v1/jobs/{job['id']}/logs").text
    a, b = json.loads(straight_out.read_text()), json.loads(resumed_out.read_text())
    assert b["start"] >= 8 and f"starting at step {b['start'] + 1} (resumed)" in logs
    assert a["weights"] == b["weights"], "the resumed run must end bit for bit where the uninterrupted one did"

    # The host comes back (a fresh agent); it registers again and takes work.
    cluster3.procs[victim].start()
    cluster3.procs[victim].wait_ready()
    api3.wait_nodes_ready(3, timeout=30)


def test_workers_of_a_node_whose_agent_died_are_fenced_before_the_job_runs_again(
        api3: Api, cluster3: LocalCluster) -> None:
    job = api3.submit({"name": "stale", "command": ["sh", "-c", "exec sleep 300"],
                       "resources": {"nodes": 2, "gpus_per_node": 1}})
    running = api3.wait(job["id"], {"running"}, timeout=60)
    victim = running["placement"][0]["node_id"]
    record = next((cluster3.workdir / "agents" / victim / "jobs" / job["id"]).glob("attempt-1/workers.json"))
    stale_pids = [w["pid"] for w in json.loads(record.read_text())["workers"]]
    assert stale_pids and all(_alive(p) for p in stale_pids)
    # Only the agent dies (a hung host, a partition): its workers run on, unsupervised, until the lease the
    # agent renewed with every answer of the scheduler runs out; their shims then kill them. The scheduler
    # releases the gang only after that, so attempt 2 never runs beside attempt 1.
    cluster3.procs[victim].kill()
    samples = []

    def restarted() -> dict[str, Any] | None:
        j = api3.job(job["id"])
        samples.append((j["attempt"], any(_alive(p) for p in stale_pids)))
        return j if j["infra_restarts"] == 1 and j["state"] == "running" else None

    moved = until(restarted, 40, "the job running again without the silent node")
    assert victim not in [a["node_id"] for a in moved["placement"]]
    assert not any(attempt > 1 and alive for attempt, alive in samples), "attempt 2 ran beside attempt 1"
    assert not any(_alive(p) for p in stale_pids)
    logs = (record.parent / "rank-0.log").read_text(errors="replace")
    assert "worker fence" in logs, logs[-500:]
    # The agent comes back; nothing of attempt 1 is adopted into anything.
    cluster3.procs[victim].start()
    cluster3.procs[victim].wait_ready()
    api3.wait_nodes_ready(3, timeout=30)
    again = api3.job(job["id"])
    assert again["state"] == "running" and again["attempt"] == 2, again
    assert api3.http.post(f"/v1/jobs/{job['id']}:cancel").status_code == 200
    api3.wait(job["id"], {"cancelled"}, timeout=30)


def test_no_node_is_declared_lost_while_the_host_is_cpu_starved(api3: Api, cluster3: LocalCluster) -> None:
    import subprocess

    job = api3.submit({"name": "steady", "command": ["sh", "-c", "exec sleep 300"],
                       "resources": {"nodes": 3, "gpus_per_node": 1}})
    api3.wait(job["id"], {"running"}, timeout=60)
    # Three busy processes per core, for longer than three node timeouts.
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3 * (os.cpu_count() or 2))]
    try:
        deadline = time.monotonic() + 3 * cluster3.node_timeout_s + 1
        while time.monotonic() < deadline:
            nodes = api3.http.get("/v1/nodes").json()["nodes"]
            assert all(n["state"] == "ready" for n in nodes), nodes
            time.sleep(0.2)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    j = api3.job(job["id"])
    assert j["state"] == "running" and j["attempt"] == 1 and j["infra_restarts"] == 0, j
    assert api3.http.post(f"/v1/jobs/{job['id']}:cancel").status_code == 200
    api3.wait(job["id"], {"cancelled"}, timeout=30)
