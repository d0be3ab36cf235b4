"""The web console in headless Chromium against the local cluster (fixtures: conftest.py): log in; the fleet page
shows every simulated node and its GPUs; a submitted job runs with live logs on its page; an XID turns a GPU
unhealthy on the node page; a viewer sees no admin controls; the queues and usage pages show what the API says.
Each test leaves screenshots in test-artifacts/console/."""

from __future__ import annotations

import re
import sys
import textwrap
from typing import Any

import pytest
from playwright.sync_api import expect

from trainyard.agent.v1 import agent_pb2, agent_pb2_grpc
from trainyard_cli.local import LocalCluster
from trainyard_core.security import identity

from ..e2e.conftest import Api
from .conftest import Screens, Tab

pytestmark = pytest.mark.e2e

WAIT_MS = 30_000
H100 = "H100-80GB-HBM3"


def _counting(lines: int, pause_s: float = 0.3) -> list[str]:
    """A worker that prints `step i` lines for a while: its page shows them arriving."""
    code = textwrap.dedent(f"""
        import os, time
        for i in range({lines}):
            print(f"step {{i}} rank {{os.environ['RANK']}}", flush=True)
            time.sleep({pause_s})
    """)
    return [sys.executable, "-u", "-c", code]


def _submit(api: Api, name: str, command: list[str], **resources: Any) -> dict[str, Any]:
    return api.submit({"name": name, "command": command,
                       "resources": {"nodes": 1, "gpus_per_node": 1, **resources}})


def _inject_xid(cluster: LocalCluster, node: str, gpu: int, xid: int) -> None:
    address = f"{cluster.address_of(node)}:{cluster.procs[node].ports['grpc_port']}"
    with cluster.sync_channel(address, identity.node(node)) as channel:
        agent_pb2_grpc.AgentServiceStub(channel).InjectFault(
            agent_pb2.InjectFaultRequest(gpu_index=gpu, kind="xid", xid=xid), timeout=10)


def test_login_then_the_fleet_shows_every_node_and_gpu(api: Api, cluster: LocalCluster, tab: Tab,
                                                       screens: Screens) -> None:
    page = tab.open()
    expect(page.get_by_test_id("login")).to_be_visible()
    page.get_by_label("API token").fill("ty_not-a-real-token")
    page.get_by_role("button", name="Log in").click()
    expect(page.get_by_test_id("login-error")).to_contain_text("token", timeout=WAIT_MS)
    screens.shoot(page, "login-refused")

    page = tab.login(cluster.token)
    expect(page.get_by_test_id("role")).to_have_text("operator")
    nodes = api.wait_nodes_ready(len(cluster.nodes))
    gpus = {f"{n['node_id']}/{g['index']}" for n in nodes for g in n["gpus"]}
    assert len(gpus) == 20  # two h100x8 and an a100x4
    heatmap = page.get_by_test_id("heatmap")
    expect(heatmap.locator("g.cell")).to_have_count(len(gpus), timeout=WAIT_MS)
    shown = {heatmap.locator("g.cell").nth(i).get_attribute("data-gpu") for i in range(len(gpus))}
    assert shown == gpus
    table = page.get_by_test_id("node-table")
    for node_id, _ in cluster.nodes:
        expect(table.locator(f'tr[data-node="{node_id}"]')).to_contain_text("ready")
    expect(page.get_by_test_id("gpus-total")).to_contain_text("20")
    for model in ("H100-80GB-HBM3", "A100-SXM4-40GB"):
        expect(page.locator(f'tr[data-model="{model}"]')).to_be_visible()
    expect(page.get_by_test_id("allocation-chart")).to_be_visible()
    # The token is in this tab's sessionStorage only: never in the address, never a cookie.
    assert cluster.token not in page.url
    assert tab.context.cookies() == []
    assert page.evaluate("sessionStorage.getItem('trainyard.token')") == cluster.token
    screens.shoot(page, "fleet")

    # A reload keeps the session; logging out forgets it.
    page.reload()
    expect(page.get_by_test_id("heatmap").locator("g.cell")).to_have_count(len(gpus), timeout=WAIT_MS)
    page.get_by_role("button", name="Log out").click()
    expect(page.get_by_test_id("login")).to_be_visible()
    assert page.evaluate("sessionStorage.getItem('trainyard.token')") is None


def test_a_submitted_job_runs_with_live_logs_on_its_page(api: Api, cluster: LocalCluster, tab: Tab,
                                                        screens: Screens) -> None:
    job = _submit(api, "console-logs", _counting(400), gpus_per_node=2, accelerator=H100)
    page = tab.login(cluster.token, f"/jobs/{job['id']}")
    expect(page.get_by_test_id("job-state")).to_have_text("running", timeout=WAIT_MS)
    logs = page.get_by_test_id("job-logs")
    expect(logs).to_contain_text("step 0 rank 0", timeout=WAIT_MS)
    expect(logs).to_contain_text("step 0 rank 1")
    expect(page.get_by_test_id("log-status")).to_have_text("live")
    # Lines keep arriving while the page is open: the stream follows the job.
    expect(logs).to_contain_text("step 12 rank 1", timeout=WAIT_MS)
    placement = api.job(job["id"])["placement"]
    (share,) = placement
    expect(page.get_by_test_id("placement-table")).to_contain_text(share["node_id"])
    topology = page.get_by_test_id("topology")
    for gpu in share["gpu_indices"]:
        expect(topology.locator(f'[data-gpu="{share["node_id"]}/{gpu}"]')).to_have_class(re.compile(r"\bmine\b"))
    expect(page.get_by_test_id("job-timeline")).to_be_visible()
    # The simulated GPUs report 0% utilization: the page says the job's GPUs are idle, as for a starved loader.
    expect(page.get_by_test_id("job-gpu-chart")).to_be_visible(timeout=WAIT_MS)
    expect(page.get_by_test_id("idle-warning")).to_be_visible(timeout=WAIT_MS)
    screens.shoot(page, "job-running")

    # The operator may cancel it from the page; the logs' stream ends with the job.
    page.get_by_test_id("cancel").click()
    expect(page.get_by_test_id("job-state")).to_have_text("cancelled", timeout=WAIT_MS)
    expect(logs).to_contain_text("the job ended: cancelled", timeout=WAIT_MS)
    expect(page.get_by_test_id("log-status")).to_have_text("ended")
    expect(page.get_by_test_id("cancel")).to_have_count(0)
    screens.shoot(page, "job-cancelled")

    # The jobs page lists it among the finished ones, linking to its page.
    page.get_by_role("link", name="Jobs").first.click()
    page.locator('button[data-filter="finished"]').click()
    row = page.get_by_test_id("job-table").locator(f'tr[data-job="{job["id"]}"]')
    expect(row).to_contain_text("cancelled", timeout=WAIT_MS)
    screens.shoot(page, "jobs")
    row.get_by_role("link", name="console-logs").click()
    expect(page.get_by_test_id("job-state")).to_have_text("cancelled", timeout=WAIT_MS)


def test_a_restarted_jobs_checkpoints_show_their_lineage(api: Api, cluster: LocalCluster, tab: Tab,
                                                         screens: Screens) -> None:
    """Attempt 1 saves steps 2 and 4 and dies after step 5; attempt 2 resumes from step 4 and saves step 6: the
    job page draws both attempts, where the second resumed from, and a row per checkpoint."""
    import shlex
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "train_with_checkpoints.py"
    base = f"{shlex.quote(sys.executable)} {shlex.quote(str(example))} --steps 6 --every 2 --sync"
    script = f'if [ "$TRAINYARD_ATTEMPT" = 1 ]; then exec {base} --stop-after 5; else exec {base}; fi'
    job = api.submit({"name": "console-lineage", "command": ["sh", "-c", script], "max_restarts": 1,
                      "restart_backoff_s": 0, "resources": {"nodes": 1, "gpus_per_node": 1}})
    done = api.wait(job["id"], {"succeeded", "failed"}, timeout=180)
    assert (done["state"], done["attempt"]) == ("succeeded", 2), done["message"]
    saved = api.http.get(f"/v1/jobs/{job['id']}/checkpoints").json()["checkpoints"]
    assert sorted((c["attempt"], c["step"]) for c in saved) == [(1, 2), (1, 4), (2, 6)]

    page = tab.login(cluster.token, f"/jobs/{job['id']}")
    lineage = page.get_by_test_id("checkpoint-lineage")
    rows = lineage.locator(".lineage-row")
    expect(rows).to_have_count(2, timeout=WAIT_MS)
    expect(rows.nth(0)).to_contain_text("attempt 1")
    expect(rows.nth(0).locator(".lineage-ckpt")).to_have_text(["step 2", "step 4"])
    expect(rows.nth(0).locator(".lineage-from")).to_have_count(0)
    expect(rows.nth(1)).to_contain_text("attempt 2")
    expect(rows.nth(1).locator(".lineage-from")).to_have_text("resumed from step 4 \u203a")
    expect(rows.nth(1).locator(".lineage-ckpt.latest")).to_have_text("step 6")
    table = page.get_by_test_id("checkpoint-table")
    for c in saved:
        expect(table.locator(f'tr[data-checkpoint="{c["id"]}"]')).to_contain_text(str(c["step"]))
    screens.shoot(page, "job-checkpoints")


def test_an_xid_turns_the_gpu_unhealthy_on_the_node_page(api: Api, cluster: LocalCluster, tab: Tab,
                                                         screens: Screens) -> None:
    node, gpu = "node-3", 2
    page = tab.login(cluster.token, f"/nodes/{node}")
    row = page.get_by_test_id("gpu-table").locator(f'tr[data-gpu="{node}/{gpu}"]')
    expect(row).to_have_attribute("data-health", "healthy", timeout=WAIT_MS)
    expect(page.get_by_test_id("chart-utilization_percent")).to_be_visible(timeout=WAIT_MS)
    for field in ("memory_used_mb", "temperature_c", "power_w"):
        expect(page.get_by_test_id(f"chart-{field}")).to_be_visible()
    # The node's GPUs drawn in their NVLink islands on the topology.
    gpus = api.http.get(f"/v1/nodes/{node}").json()["gpus"]
    # One box per NVLink island, and one per GPU outside any (island -1: PCIe only).
    islands = {g["nvlink_island"] if g["nvlink_island"] >= 0 else f"pcie-{g['index']}" for g in gpus}
    topology = page.locator(f'.topo-node[data-node="{node}"]')
    expect(topology.locator(".topo-island .topo-gpu")).to_have_count(len(gpus))
    expect(topology.locator(".topo-island")).to_have_count(len(islands))
    try:
        _inject_xid(cluster, node, gpu, 79)
        expect(row).to_have_attribute("data-health", "unhealthy", timeout=WAIT_MS)
        expect(row.get_by_test_id("gpu-health")).to_have_text("unhealthy")
        expect(row).to_contain_text("XID 79")
        events = page.get_by_test_id("gpu-events")
        expect(events.locator(f'tr.xid[data-gpu="{gpu}"]')).to_contain_text("XID 79", timeout=WAIT_MS)
        expect(events.locator(f'tr.health[data-gpu="{gpu}"]')).to_contain_text("unhealthy")
        # XID 79 drains the node: the scheduler cordons it, and the operator sees the uncordon control.
        expect(page.get_by_test_id("uncordon")).to_be_visible(timeout=WAIT_MS)
        screens.shoot(page, "node-xid")

        page.goto(tab.base + "#/fleet")
        cell = page.get_by_test_id("heatmap").locator(f'g.cell[data-gpu="{node}/{gpu}"]')
        expect(cell).to_have_attribute("data-health", "unhealthy", timeout=WAIT_MS)
        screens.shoot(page, "fleet-with-unhealthy-gpu")
    finally:
        # Put the node back for the tests after this one, as an operator would after the repair.
        api.http.post(f"/v1/nodes/{node}/gpus/{gpu}:set-health", json={"healthy": True, "reason": "reseated"})
        api.http.post(f"/v1/nodes/{node}:uncordon")


def test_a_viewer_sees_no_admin_controls(api: Api, cluster: LocalCluster, tab: Tab, second_tab: Tab,
                                         screens: Screens) -> None:
    viewer = _token(api, "vision", "vera", "viewer")
    member = _token(api, "vision", "mia", "member")
    job = api.http.post("/v1/jobs", headers={"Authorization": f"Bearer {member}"},
                        json={"name": "team-job", "command": _counting(2000, 0.5),
                              "resources": {"nodes": 1, "gpus_per_node": 1, "accelerator": H100}})
    assert job.status_code == 201, job.text
    job_id = job.json()["id"]
    try:
        api.wait(job_id, {"running"})
        # The operator, for contrast: the node and job pages carry their controls.
        admin = second_tab.login(cluster.token, "/nodes/node-1")
        expect(admin.get_by_test_id("cordon")).to_be_visible(timeout=WAIT_MS)
        expect(admin.get_by_test_id("gpu-table").locator(".admin-control")).to_have_count(8)
        admin.goto(second_tab.base + f"#/jobs/{job_id}")
        expect(admin.get_by_test_id("cancel")).to_be_visible(timeout=WAIT_MS)

        page = tab.login(viewer, "/nodes/node-1")
        expect(page.get_by_test_id("role")).to_have_text("viewer")
        expect(page.get_by_test_id("gpu-table").locator("tr[data-gpu]")).to_have_count(8, timeout=WAIT_MS)
        expect(page.get_by_test_id("chart-utilization_percent")).to_be_visible(timeout=WAIT_MS)
        expect(page.locator(".admin-control")).to_have_count(0)
        expect(page.get_by_test_id("node-admin")).to_have_count(0)
        screens.shoot(page, "viewer-node")

        page.goto(tab.base + f"#/jobs/{job_id}")
        expect(page.get_by_test_id("job-state")).to_have_text("running", timeout=WAIT_MS)
        expect(page.get_by_test_id("job-logs")).to_contain_text("step 0 rank 0", timeout=WAIT_MS)
        expect(page.locator(".admin-control")).to_have_count(0)
        screens.shoot(page, "viewer-job")
    finally:
        api.http.post(f"/v1/jobs/{job_id}:cancel")


def test_queues_show_why_jobs_wait_and_usage_charts_and_exports(api: Api, cluster: LocalCluster, tab: Tab,
                                                               screens: Screens) -> None:
    # Every H100 taken: the next H100 job waits, and the scheduler says why; another is held back.
    filler = _submit(api, "filler", _counting(2000, 0.5), nodes=2, gpus_per_node=8, accelerator=H100)
    api.wait(filler["id"], {"running"})
    blocked = _submit(api, "no-room", _counting(1), gpus_per_node=4, accelerator=H100)
    held = _submit(api, "held-back", _counting(1), gpus_per_node=2, accelerator=H100)
    assert api.http.post(f"/v1/jobs/{held['id']}:hold", json={"reason": "console test"}).status_code == 200
    quota = api.http.put("/v1/quotas/admin", json={"limits": {"*": {"nominal": 64, "borrow_limit": 0}}})
    assert quota.status_code in (200, 201), quota.text
    try:
        page = tab.login(cluster.token, "/queues")
        # The quota with what the team holds now: the filler's 16 GPUs, none borrowed.
        quota_row = page.get_by_test_id("quota-table").locator('tr[data-team="admin"][data-key="*"]')
        expect(quota_row).to_contain_text("64", timeout=WAIT_MS)
        expect(quota_row.locator("td").nth(5)).to_have_text("16", timeout=WAIT_MS)
        pending = page.get_by_test_id("pending-table")
        row = pending.locator(f'tr[data-job="{blocked["id"]}"]')
        expect(row).to_be_visible(timeout=WAIT_MS)
        reason = _pending_reason(api, blocked["id"])
        expect(row).to_contain_text(reason)
        expect(pending.locator(f'tr[data-job="{held["id"]}"]')).to_contain_text("held", timeout=WAIT_MS)
        screens.shoot(page, "queues")

        page.goto(tab.base + "#/usage")
        expect(page.get_by_test_id("usage-gpu-hours")).to_be_visible(timeout=WAIT_MS)
        total = api.http.get("/v1/usage", params={"group_by": "team"}).json()["total"]["gpu_hours"]
        assert total > 0  # the jobs of the tests before this one
        expect(page.get_by_test_id("usage-chart")).to_be_visible()
        expect(page.get_by_test_id("usage-table")).to_contain_text("admin")
        with page.expect_download() as download:
            page.get_by_test_id("usage-csv").click()
        csv = download.value.path().read_text()
        header, *rows = csv.splitlines()
        assert header == "day,team,gpu_hours,cpu_hours,cost,currency,unpriced_gpu_hours"
        assert rows and all(re.match(r"^\d{4}-\d{2}-\d{2},", r) for r in rows)
        assert any(",admin," in r for r in rows)
        screens.shoot(page, "usage")
    finally:
        api.http.delete("/v1/quotas/admin")
        for job in (blocked, held, filler):
            api.http.post(f"/v1/jobs/{job['id']}:cancel")


def _token(api: Api, team: str, user: str, role: str) -> str:
    reply = api.http.post("/v1/tokens", json={"team": team, "user": user, "role": role})
    assert reply.status_code == 201, reply.text
    return str(reply.json()["secret"])


def _pending_reason(api: Api, job_id: str) -> str:
    """The scheduler's reason for the job's wait, once a cycle has considered it."""
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        jobs = api.http.get("/v1/pending", params={"job_id": job_id}).json()["jobs"]
        if jobs and jobs[0]["reason"]:
            return str(jobs[0]["reason"])
        time.sleep(0.2)
    raise AssertionError(f"no reason given for {job_id}'s wait after 30 s")
