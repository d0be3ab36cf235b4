"""The local cluster's real processes (etcd, scheduler, checkpoint-store, gateway, the default simulated nodes),
started once for the e2e module that asks for them."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from trainyard_cli.local import LocalCluster

TERMINAL = {"succeeded", "failed", "cancelled"}


class Api:
    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.http = httpx.Client(base_url=cluster.url, headers={"Authorization": f"Bearer {cluster.token}"},
                                 timeout=30)

    def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        r = self.http.post("/v1/jobs", json=spec)
        assert r.status_code == 201, r.text
        return r.json()

    def job(self, job_id: str) -> dict[str, Any]:
        r = self.http.get(f"/v1/jobs/{job_id}")
        assert r.status_code == 200, r.text
        return r.json()

    def wait(self, job_id: str, states: set[str], timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        job: dict[str, Any] = {}
        while time.monotonic() < deadline:
            try:
                job = self.job(job_id)
            except httpx.TransportError:
                job = {}
            if job.get("state") in states:
                return job
            if job.get("state") in TERMINAL:
                raise AssertionError(f"job {job_id} ended {job['state']}, wanted {states}: {job.get('message')}")
            time.sleep(0.1)
        raise AssertionError(f"job {job_id} not in {states} after {timeout}s: {job}")

    def wait_nodes_ready(self, count: int, timeout: float = 30.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        nodes: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            r = self.http.get("/v1/nodes")
            if r.status_code == 200:
                nodes = r.json()["nodes"]
                if sum(1 for n in nodes if n["state"] == "ready") >= count:
                    return nodes
            time.sleep(0.1)
        raise AssertionError(f"{count} ready nodes not seen after {timeout}s: {nodes}")


@contextlib.contextmanager
def local_cluster(tmp_path_factory: pytest.TempPathFactory, name: str, *, log_format: str = "text",
                  **options: Any) -> Iterator[LocalCluster]:
    """A started LocalCluster (free gateway port, short stop grace, text logs unless `log_format` says json),
    stopped at exit."""
    c = LocalCluster(Path(tmp_path_factory.mktemp(name)), gateway_port=0, stop_grace_s=2.0, log_format=log_format,
                     **options)
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with local_cluster(tmp_path_factory, "cluster") as c:
        yield c


@pytest.fixture(scope="module")
def api(cluster: LocalCluster) -> Iterator[Api]:
    a = Api(cluster)
    a.wait_nodes_ready(len(cluster.nodes))
    yield a
    a.http.close()
