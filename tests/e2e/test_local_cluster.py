"""End to end through the local cluster's real processes: HTTP → scheduler → etcd → agents → workers."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from trainyard_core.testing.wait import until

from .conftest import TERMINAL, Api

pytestmark = pytest.mark.e2e
PROGRAMS = Path(__file__).parent / "programs"


def test_two_node_torch_job_succeeds_and_logs_show_both_ranks(api: Api) -> None:
    """The README tour's minimal spec, as a newcomer sends it: no accelerator, no allow_mixed. The default
    cluster has two H100 nodes, so one gang of one model fits."""
    job = api.submit({"name": "allreduce", "command": [sys.executable, str(PROGRAMS / "allreduce.py")],
                      "resources": {"nodes": 2, "gpus_per_node": 1}})
    assert job["state"] == "pending"
    done = api.wait(job["id"], {"succeeded"}, timeout=120)
    assert sorted(e["rank"] for e in done["exits"]) == [0, 1]
    assert {a["node_id"] for a in done["placement"]} == {"node-1", "node-2"}
    logs = api.http.get(f"/v1/jobs/{job['id']}/logs").text
    assert "[rank 0] rank 0/2 node 0 local 0 gpu 0 allreduce=1 expected=1" in logs
    assert "[rank 1] rank 1/2 node 1 local 0 gpu 0 allreduce=1 expected=1" in logs


def test_mixed_models_gang_uses_the_other_model(api: Api) -> None:
    """Heterogeneity on the default cluster: three nodes need both models, which allow_mixed permits."""
    job = api.submit({"name": "mixed", "command": [sys.executable, "-c", "pass"],
                      "resources": {"nodes": 3, "gpus_per_node": 1, "allow_mixed": True}})
    done = api.wait(job["id"], {"succeeded"}, timeout=120)
    assert {a["node_id"] for a in done["placement"]} == {"node-1", "node-2", "node-3"}


def test_exit_code_is_reported_as_failed(api: Api) -> None:
    job = api.submit({"name": "exit-3", "command": [sys.executable, "-c", "raise SystemExit(3)"],
                      "resources": {"nodes": 1, "gpus_per_node": 1}})
    done = api.wait(job["id"], {"failed"})
    assert done["exit_code"] == 3
    assert "exited with code 3" in done["message"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it has exited all the same.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_cancel_kills_workers_and_frees_gpus(api: Api, tmp_path: Path) -> None:
    # Take every GPU of node-3 (a100x4) so the follow-up job can only run once they are freed.
    job = api.submit({"name": "to-cancel", "command": [sys.executable, str(PROGRAMS / "record_pid_and_wait.py"),
                                                       str(tmp_path)],
                      "resources": {"nodes": 1, "gpus_per_node": 4, "accelerator": "A100-SXM4-40GB"}})
    api.wait(job["id"], {"running"})
    deadline = time.monotonic() + 30
    while len(list(tmp_path.glob("rank-*.pids"))) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = [int(p) for f in tmp_path.glob("rank-*.pids") for p in f.read_text().split()]
    assert len(pids) == 8 and all(_alive(p) for p in pids)

    follow = api.submit({"name": "after-cancel", "command": [sys.executable, "-c", "print('ok')"],
                         "resources": {"nodes": 1, "gpus_per_node": 4, "accelerator": "A100-SXM4-40GB"}})
    assert api.job(follow["id"])["state"] == "pending"

    r = api.http.post(f"/v1/jobs/{job['id']}:cancel")
    assert r.status_code in (200, 202), r.text
    cancelled = api.wait(job["id"], {"cancelled"}, timeout=30)
    assert cancelled["state"] == "cancelled"
    leftover = [p for p in pids if _alive(p)]
    assert leftover == [], f"orphaned worker processes: {leftover}"
    api.wait(follow["id"], {"succeeded"}, timeout=60)


def test_scheduler_restart_does_not_lose_a_submitted_job(api: Api) -> None:
    cluster = api.cluster
    # Keep the job pending across the restart: it needs more A100s than are free while a blocker runs.
    blocker = api.submit({"name": "blocker", "command": [sys.executable, "-c", "import time; time.sleep(3600)"],
                          "resources": {"nodes": 1, "gpus_per_node": 4, "accelerator": "A100-SXM4-40GB"}})
    api.wait(blocker["id"], {"running"})
    waiting = api.submit({"name": "survivor", "command": [sys.executable, "-c", "print('survived')"],
                          "resources": {"nodes": 1, "gpus_per_node": 4, "accelerator": "A100-SXM4-40GB"}})
    assert api.job(waiting["id"])["state"] == "pending"

    cluster.restart("scheduler", kill=True)  # SIGKILL: no clean hand-over

    assert api.job(waiting["id"])["state"] == "pending"
    assert api.job(blocker["id"])["state"] == "running"
    r = api.http.post(f"/v1/jobs/{blocker['id']}:cancel")
    assert r.status_code in (200, 202), r.text
    api.wait(blocker["id"], {"cancelled"}, timeout=60)
    api.wait(waiting["id"], {"succeeded"}, timeout=60)
    assert "[rank 0] survived" in api.http.get(f"/v1/jobs/{waiting['id']}/logs").text


def test_following_a_finished_jobs_logs_over_mtls_ends_with_its_lines_and_no_warning(api: Api) -> None:
    """The gateway asks each agent whether the attempt's workers have ended (ListWorkers) when an agent's log
    stream ends: refused by the agents' authorization table, every follow of a finished job warned that the
    node could not be read, and ended only after three refusals."""
    job = api.submit({"name": "followed", "command": [sys.executable, "-c", "print('to the end')"],
                      "resources": {"nodes": 1, "gpus_per_node": 1}})
    api.wait(job["id"], {"succeeded"})
    with api.http.stream("GET", f"/v1/jobs/{job['id']}/logs", params={"follow": "true"}, timeout=60) as r:
        assert r.status_code == 200
        events = r.read().decode()
    assert "to the end" in events, events
    assert "event: warning" not in events, events


def test_an_agent_that_stops_with_its_workers_has_their_job_restarted_not_failed(api: Api) -> None:
    """The local cluster's agents stop with their workers (kill_workers_on_stop), as every node does when
    `make run` is stopped: the job that ran there is restarted as after a lost node, its restart budget
    untouched, not failed for a rank killed by a signal."""
    job = api.submit({"name": "outlives-its-agent", "command": [sys.executable, "-c", "import time; time.sleep(3600)"],
                      "resources": {"nodes": 1, "gpus_per_node": 1}})
    first = api.wait(job["id"], {"running"})
    (node,) = {a["node_id"] for a in first["placement"]}
    api.cluster.restart(node)  # SIGTERM: the agent ends its workers and reports their exits before it goes

    def running_again() -> dict[str, Any] | None:
        now = api.job(job["id"])
        assert now["state"] not in TERMINAL, now
        return now if now["state"] == "running" and now["attempt"] > first["attempt"] else None
    again = until(running_again, 60, "the job running again as a new attempt", interval=0.1)
    assert (again["restarts"], again["infra_restarts"]) == (0, 1), again
    (ended,) = again["attempts"]
    assert "stopped by its node's agent shutting down" in ended["reason"], ended
    r = api.http.post(f"/v1/jobs/{job['id']}:cancel")
    assert r.status_code in (200, 202), r.text
    api.wait(job["id"], {"cancelled"}, timeout=60)


def test_a_failed_start_leaves_no_process(tmp_path: Path) -> None:
    """Regression: a service that failed to come up left the ones already started running."""
    from trainyard_cli.local import LocalCluster

    cluster = LocalCluster(tmp_path, gateway_port=0, nodes=[("node-1", "no-such-profile")])
    with pytest.raises(RuntimeError, match="node-1 exited"):
        cluster.start()
    assert cluster.procs and all(p.popen is not None and p.popen.poll() is not None for p in cluster.procs.values())
    assert cluster.etcd is not None and cluster.etcd.proc is not None and cluster.etcd.proc.poll() is not None
