"""Submit → all workers running, end to end through the local cluster (gateway → scheduler → etcd →
agent → process), over 20 one-node jobs (TINY: 3), with mTLS on as in production. Baselines, same run:
starting the same Python interpreter directly with subprocess until it prints its first byte — the floor
any launcher of a Python worker pays — and the same cluster with every service on insecure_plaintext
(`tls_vs_plaintext_p50`: what mTLS and authorization cost on this path; target <= 1.2)."""

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
        # Both clusters up at once and their jobs alternated, so the machine's noise hits both alike.
        clusters = {tls: LocalCluster(Path(tmp) / ("tls" if tls else "plaintext"), gateway_port=0,
                                      nodes=[("node-1", "h100x8")], tls=tls) for tls in (True, False)}
        try:
            for cluster in clusters.values():
                cluster.start()
            clients = {tls: httpx.Client(base_url=c.url, headers={"Authorization": f"Bearer {c.token}"}, timeout=30)
                       for tls, c in clusters.items()}
            latencies: dict[bool, list[float]] = {True: [], False: []}
            for client in clients.values():
                _wait_nodes(client)
            for i in range(config.jobs):
                for tls in ((True, False) if i % 2 == 0 else (False, True)):
                    latencies[tls].append(_submit_until_running(clients[tls], i))
            for client in clients.values():
                client.close()
        finally:
            for cluster in clusters.values():
                cluster.stop()
    tls_on, plain = latencies[True], latencies[False]
    p50 = statistics.median(tls_on)
    return {
        "submit_to_running_p50_s": p50,
        "submit_to_running_p95_s": _pct(tls_on, 0.95),
        "submit_to_running_p50_s_plaintext": statistics.median(plain),
        "submit_to_running_p95_s_plaintext": _pct(plain, 0.95),
        "tls_vs_plaintext_p50": p50 / statistics.median(plain),
        "direct_spawn_p50_s": statistics.median(direct),
        "submit_to_running_p50_vs_direct_spawn": p50 / statistics.median(direct),
        "jobs": float(len(tls_on)),
    }


def _submit_until_running(client: httpx.Client, i: int) -> float:
    spec = {"name": f"lat-{i}", "command": COMMAND, "resources": {"nodes": 1, "gpus_per_node": 1}}
    t0 = time.perf_counter()
    r = client.post("/v1/jobs", json=spec)
    r.raise_for_status()
    job_id = r.json()["id"]
    until(functools.partial(_started, client, job_id), 60.0, functools.partial(_describe, client, job_id),
          interval=0.005)
    return time.perf_counter() - t0


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
