"""Submit → all workers running, end to end through the local cluster (gateway → scheduler → etcd →
agent → process), over 20 one-node jobs (TINY: 3). Baseline, same run: starting the same Python interpreter directly
with subprocess until it prints its first byte — the floor any launcher of a Python worker pays."""

from __future__ import annotations

import functools
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from trainyard_cli.local import LocalCluster
from trainyard_core.testing.wait import until

COMMAND = [sys.executable, "-c", "import time; time.sleep(0.2)"]


@dataclass(frozen=True)
class Config:
    jobs: int = 20


TINY = Config(jobs=3)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _direct_spawn() -> float:
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.stdout.write('x'); sys.stdout.flush()"],
                         stdout=subprocess.PIPE)
    assert p.stdout is not None
    p.stdout.read(1)
    took = time.perf_counter() - t0
    p.wait()
    return took


def run(config: Config = Config()) -> dict[str, float]:
    direct = [_direct_spawn() for _ in range(config.jobs)]
    with tempfile.TemporaryDirectory(prefix="trainyard-bench-") as tmp:
        cluster = LocalCluster(Path(tmp), gateway_port=0, nodes=[("node-1", "h100x8")])
        cluster.start()
        try:
            headers = {"Authorization": f"Bearer {cluster.token}"}
            latencies: list[float] = []
            with httpx.Client(base_url=cluster.url, headers=headers, timeout=30) as client:
                _wait_nodes(client)
                for i in range(config.jobs):
                    spec = {"name": f"lat-{i}", "command": COMMAND, "resources": {"nodes": 1, "gpus_per_node": 1}}
                    t0 = time.perf_counter()
                    r = client.post("/v1/jobs", json=spec)
                    r.raise_for_status()
                    job_id = r.json()["id"]
                    until(functools.partial(_started, client, job_id), 60.0,
                          functools.partial(_describe, client, job_id), interval=0.005)
                    latencies.append(time.perf_counter() - t0)
        finally:
            cluster.stop()
    p50 = statistics.median(latencies)
    return {
        "submit_to_running_p50_s": p50,
        "submit_to_running_p95_s": _pct(latencies, 0.95),
        "direct_spawn_p50_s": statistics.median(direct),
        "submit_to_running_p50_vs_direct_spawn": p50 / statistics.median(direct),
        "jobs": float(len(latencies)),
    }


def _started(client: httpx.Client, job_id: str) -> bool:
    state = client.get(f"/v1/jobs/{job_id}").json()["state"]
    if state in ("failed", "cancelled"):
        raise RuntimeError(f"job {job_id} ended {state}")
    return state in ("running", "succeeded")


def _describe(client: httpx.Client, job_id: str) -> str:
    job = client.get(f"/v1/jobs/{job_id}").json()
    return f"job {job_id} running (it is {job.get('state')}; last events {job.get('events', [])[-3:]})"


def _wait_nodes(client: httpx.Client, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = client.get("/v1/nodes")
        if r.status_code == 200 and any(n.get("state") == "ready" for n in r.json().get("nodes", [])):
            return
        time.sleep(0.1)
    raise RuntimeError("no node became ready")
