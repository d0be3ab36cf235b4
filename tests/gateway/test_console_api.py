"""What the web console reads besides the existing API, against a real gateway, scheduler and agents (simulated
GPUs): GET /v1/whoami (who the token is, what it may do), GET /v1/nodes/{id}/metrics (the agent's ring buffer:
values follow the fake NVML, XIDs and health changes, validation, unreachable agents), GET /v1/fleet/metrics
(the allocation the gateway records, every GPU's latest poll); and /console's files (CSP, ETag, no path out)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from trainyard_core.contract import Role
from trainyard_core.testing.wait import eventually
from trainyard_gateway.roles import RULES, Action

from .support import Cluster, RunningGateway, python, running_cluster, running_gateway


@pytest.fixture
async def quick_gateway(etcd_settings: dict[str, str], cluster: Cluster) -> AsyncIterator[RunningGateway]:
    """The cluster's gateway recording the fleet's allocation every 0.1 s, linking to a Prometheus."""
    async with running_gateway(etcd=etcd_settings, etcd_prefix=cluster.settings.etcd_prefix,
                               scheduler_address=cluster.address, fleet_sample_interval_s=0.1,
                               console_prometheus_url="http://prometheus.example:9090/graph") as gw:
        yield gw


# --- GET /v1/whoami ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("role", list(Role))
async def test_whoami_names_the_token_and_the_actions_its_role_allows(gateway: RunningGateway, role: Role) -> None:
    secret = await gateway.create_token("vision", "alice", role=role.value)
    async with gateway.client(secret) as http:
        reply = await http.get("/v1/whoami")
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert (body["token"]["team"], body["token"]["user"], body["token"]["role"]) == ("vision", "alice", role.value)
    assert "secret" not in body and secret not in reply.text
    assert body["actions"] == [a.value for a in Action if role.at_least(RULES[a].role)]


async def test_whoami_narrows_by_scopes_and_needs_a_token(gateway: RunningGateway) -> None:
    scoped = await gateway.create_token("vision", "carol", role="admin", scopes=["jobs:read", "nodes:read"])
    async with gateway.client(scoped) as http:
        body = (await http.get("/v1/whoami")).json()
    assert body["token"]["scopes"] == ["jobs:read", "nodes:read"]
    assert body["actions"] == ["jobs.read", "nodes.read", "checkpoints.read"]
    async with gateway.client() as http:
        assert (await http.get("/v1/whoami")).status_code == 401
    async with gateway.client("ty_not-a-token") as http:
        assert (await http.get("/v1/whoami")).status_code == 401


# --- GET /v1/nodes/{id}/metrics ------------------------------------------------------------------------------

async def test_node_metrics_follow_the_fake_nvml_and_show_xids(cluster: Cluster,
                                                               cluster_gateway: RunningGateway) -> None:
    fake = cluster.agents["node-a"].fake
    assert fake is not None
    fake.set_load(2, 91, 12_000)
    viewer = await cluster_gateway.create_token("vision", "vic", role="viewer")
    async with cluster_gateway.client(viewer) as http:
        async def loaded() -> dict | None:  # type: ignore[type-arg]
            body = (await http.get("/v1/nodes/node-a/metrics", params={"window": 60, "points": 50})).json()
            gpu2 = [g for g in body["gpus"] if g["index"] == 2]
            return body if gpu2 and gpu2[0]["samples"] and gpu2[0]["samples"][-1]["utilization_percent"] == 91 \
                else None

        body = await eventually(loaded, timeout=10, what="GPU 2 of node-a at 91% through the API")
        assert body["node_id"] == "node-a" and body["window_s"] == 60
        assert [g["index"] for g in body["gpus"]] == [0, 1, 2, 3]
        assert body["gpus"][2]["samples"][-1]["memory_used_mb"] == 12_000
        assert all(len(g["samples"]) <= 50 for g in body["gpus"])
        assert body["interval_s"] == pytest.approx(0.2)
        assert body["retained_since"] is not None and body["retained_since"] <= body["as_of"]
        latest = (await http.get("/v1/nodes/node-a/metrics", params={"window": 0})).json()
        assert all(len(g["samples"]) == 1 for g in latest["gpus"])

        await cluster.inject_fault("node-a", 1, "xid", xid=79)

        async def flagged() -> list | None:  # type: ignore[type-arg]
            events = (await http.get("/v1/nodes/node-a/metrics")).json()["events"]
            return events if any(e["kind"] == "health" and e["gpu"] == 1 for e in events) else None

        events = await eventually(flagged, timeout=10, what="GPU 1's XID and health change in the node's history")
        mine = [(e["kind"], e["xid"], e["health"]) for e in events if e["gpu"] == 1]
        assert mine == [("xid", 79, "unhealthy"), ("health", 0, "unhealthy")]
        assert "XID 79" in next(e for e in events if e["gpu"] == 1)["reason"]


@pytest.mark.parametrize(("params", "name"), [({"window": -1}, "window"), ({"window": 86_401}, "window"),
                                              ({"points": 0}, "points"), ({"points": 2_001}, "points"),
                                              ({"window": "soon"}, "window")])
async def test_node_metrics_refuse_out_of_range_parameters(cluster_gateway: RunningGateway, params: dict,  # type: ignore[type-arg]
                                                           name: str) -> None:
    async with cluster_gateway.client(cluster_gateway.admin_token) as http:
        reply = await http.get("/v1/nodes/node-a/metrics", params=params)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["code"] == "invalid_argument" and name in reply.json()["error"]["message"]


async def test_node_metrics_of_unknown_and_unreachable_nodes(etcd_settings: dict[str, str], key_prefix: str,
                                                             tmp_path: Path) -> None:
    # A long node timeout: the stopped agent's node stays "ready" at the scheduler while the test asks.
    async with running_cluster(etcd=etcd_settings, prefix=key_prefix + "unreachable", state_root=tmp_path,
                               agents={"node-a": "a100x4", "node-b": "a100x4"}, node_timeout_s=60,
                               worker_fence_s=90) as cluster, \
            running_gateway(etcd=etcd_settings, etcd_prefix=cluster.settings.etcd_prefix,
                            scheduler_address=cluster.address) as gw:
        address = f"127.0.0.1:{cluster.agents['node-b'].grpc_port}"
        await cluster.stop_agent("node-b")
        viewer = await gw.create_token("vision", "vic", role="viewer")
        async with gw.client(viewer) as http:
            missing = await http.get("/v1/nodes/node-zzz/metrics")
            assert missing.status_code == 404 and "node-zzz" in missing.json()["error"]["message"]
            down = await http.get("/v1/nodes/node-b/metrics")
            assert down.status_code == 503, down.text
            assert "node-b" in down.json()["error"]["message"] and address not in down.text
            fleet = (await http.get("/v1/fleet/metrics")).json()
        assert [(u["node_id"], address in u["message"]) for u in fleet["unreachable"]] == [("node-b", False)]
        b_gpus = [g for g in fleet["gpus"] if g["node_id"] == "node-b"]
        assert len(b_gpus) == 4 and all(g["utilization_percent"] is None for g in b_gpus)
        assert all(g["utilization_percent"] is not None for g in fleet["gpus"] if g["node_id"] == "node-a")
        async with gw.client(gw.admin_token) as http:
            down = await http.get("/v1/nodes/node-b/metrics")
        assert down.status_code == 503 and address in down.json()["error"]["message"]  # operators see where


# --- GET /v1/fleet/metrics ----------------------------------------------------------------------------------

async def test_fleet_metrics_record_the_allocation_and_every_gpus_latest_poll(cluster: Cluster,
                                                                             quick_gateway: RunningGateway) -> None:
    member = await quick_gateway.create_token("vision", "alice")
    cluster.agents["node-b"].fake.set_load(0, 64, 1_000)  # type: ignore[union-attr]
    # Nobody asked yet: the gateway has asked the scheduler nothing for the history.
    assert "ListNodes" not in cluster.calls.methods
    async with quick_gateway.client(member) as http:
        first = (await http.get("/v1/fleet/metrics")).json()
        assert [(p["gpus_total"], p["gpus_allocated"]) for p in first["allocation"]] == [(8, 0)]
        job = (await http.post("/v1/jobs", json={"name": "hold-three",
                                                 "command": python("import time; time.sleep(600)"),
                                                 "resources": {"nodes": 1, "gpus_per_node": 3}})).json()

        async def allocated() -> dict | None:  # type: ignore[type-arg]
            body = (await http.get("/v1/fleet/metrics", params={"window": 600})).json()
            points = body["allocation"]
            return body if points and points[-1]["gpus_allocated"] == 3 else None

        body = await eventually(allocated, timeout=20, what="3 GPUs held in the recorded allocation")
        last = body["allocation"][-1]
        assert (last["nodes_ready"], last["nodes_total"], last["gpus_total"]) == (2, 2, 8)
        assert last["models"] == {"A100-SXM4-40GB": {"total": 8, "allocated": 3}}
        assert body["sample_interval_s"] == 0.1 and body["window_s"] == 600
        # Recorded by the gateway between the requests, every 0.1 s, from the first request's point on.
        times = [p["time"] for p in body["allocation"]]
        assert times == sorted(times) and times[0] == first["allocation"][0]["time"]
        assert body["allocation"][0]["gpus_allocated"] == 0 and len(times) >= 2
        assert [(g["node_id"], g["index"]) for g in body["gpus"]] == [(n, i) for n in ("node-a", "node-b")
                                                                       for i in range(4)]
        assert sum(g["allocated"] for g in body["gpus"]) == 3 and body["unreachable"] == []

        async def busy() -> bool:
            gpus = (await http.get("/v1/fleet/metrics")).json()["gpus"]
            return any(g["node_id"] == "node-b" and g["index"] == 0 and g["utilization_percent"] == 64 for g in gpus)

        await eventually(busy, timeout=10, what="node-b's GPU 0 at 64% in the fleet's latest polls")
        narrow = (await http.get("/v1/fleet/metrics", params={"window": 0})).json()
        assert len(narrow["allocation"]) <= 1
        assert (await http.post(f"/v1/jobs/{job['id']}:cancel")).status_code in (200, 202)
        bad = await http.get("/v1/fleet/metrics", params={"window": 90_000})
        assert bad.status_code == 400 and "window" in bad.json()["error"]["message"]


# --- /console -------------------------------------------------------------------------------------------------

async def test_console_files_are_served_with_a_strict_policy(quick_gateway: RunningGateway) -> None:
    async with quick_gateway.client() as http:
        root = await http.get("/console", follow_redirects=False)
        assert root.status_code == 307 and root.headers["location"] == "/console/"
        page = await http.get("/console/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert '<script type="module" src="app.js">' in page.text
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "connect-src 'self'" in csp and "frame-ancestors 'none'" in csp
        assert "unsafe-inline" not in csp and page.headers["x-content-type-options"] == "nosniff"
        script = await http.get("/console/app.js")
        assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
        again = await http.get("/console/app.js", headers={"If-None-Match": script.headers["etag"]})
        assert again.status_code == 304 and again.content == b""
        config = await http.get("/console/config.json")
        assert config.json() == {"prometheus_url": "http://prometheus.example:9090/graph"}
        for name in ("nope.js", "..%2Fsettings.py", "router.py", "__init__.py", ".hidden.js"):
            missing = await http.get(f"/console/{name}")
            assert missing.status_code == 404, name
        # The console is no part of the API's document.
        doc = (await http.get("/openapi.json")).json()
        assert not any(path.startswith("/console") for path in doc["paths"])
        assert {"/v1/whoami", "/v1/nodes/{node_id}/metrics", "/v1/fleet/metrics"} <= set(doc["paths"])


def test_every_console_module_the_page_imports_is_shipped() -> None:
    """Each `import ... from "./x.js"` of the console names a file of the package (a missing one would leave
    the page blank, with nothing but a console error to say why)."""
    import re

    from trainyard_gateway.console.router import STATIC, load

    shipped = set(load())
    for name in shipped:
        if name.endswith(".js"):
            imported = set(re.findall(r'from "\./([a-z0-9_-]+\.js)"', (STATIC / name).read_text()))
            assert imported <= shipped, (name, imported - shipped)
    assert {"index.html", "app.js", "console.css", "favicon.svg"} <= shipped
