"""The gateway is SIGKILLed and started again while a job runs: the job is not disturbed (same worker pids,
same attempt, it finishes SUCCEEDED), and the API answers again on the same address to the same tokens —
the bootstrap admin token and a team token created through the API before the restart (its record lives
in etcd, not in the gateway)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from trainyard_cli.local import LocalCluster

from .support import Agents, Gateway, assert_ran_once, hold_spec, release, until

pytestmark = pytest.mark.e2e


def test_gateway_restart_leaves_running_jobs_alone_and_keeps_its_tokens(cluster: LocalCluster, gateway: Gateway,
                                                                         agents: Agents, tmp_path: Path) -> None:
    r = gateway.http.post("/v1/tokens", json={"team": "restart-team", "user": "alice",
                                              "description": "made before a gateway restart"})
    assert r.status_code == 201, r.text
    team = httpx.Client(base_url=cluster.url, headers={"Authorization": f"Bearer {r.json()['secret']}"},
                        timeout=10)
    try:
        r = team.post("/v1/jobs", json=hold_spec("through-gateway-restart", tmp_path))
        assert r.status_code == 201, r.text
        job = r.json()
        gateway.wait_state(job["id"], {"running"})
        workers = until(lambda: agents.running(job["id"]), 20, "the job's worker on its agent")

        proc = cluster.procs["gateway"]
        port = proc.ports["http_port"]
        proc.kill()
        with pytest.raises(httpx.TransportError):
            gateway.http.get(f"/v1/jobs/{job['id']}")
        assert agents.running(job["id"]) == workers, "the job's workers changed while the gateway was down"

        started_at = time.monotonic()
        proc.start()
        assert proc.wait_ready()["http_port"] == port
        again = until(lambda: gateway.try_job(job["id"]), 20, "the admin token to be answered again")
        print(f"\ngateway restart: answering again {time.monotonic() - started_at:.2f}s after the new process started")
        assert (again["state"], again["attempt"]) == ("running", 1)
        r = team.get(f"/v1/jobs/{job['id']}")
        assert r.status_code == 200, f"the team token is no longer accepted: {r.status_code} {r.text}"
        assert agents.running(job["id"]) == workers

        release(tmp_path, job["id"])
        done = gateway.wait_state(job["id"], {"succeeded"}, timeout=30)
        assert_ran_once(tmp_path, done)
        assert "released" in team.get(f"/v1/jobs/{job['id']}/logs").text
    finally:
        team.close()
